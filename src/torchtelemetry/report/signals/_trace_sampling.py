"""Which ranks a window's trace comes from: the slowest, the fastest and one rotating through the world.

Every rank decides alike, from the window's reduced values it already has (each rank's seconds per
step in each phase, its data wait, sync wait and step time), so nothing extra is communicated:

- the slowest: the rank the other ranks wait for longest in any phase: its seconds per step there
  less the median of the other ranks' (the straggler cost), each phase taken as the straggler scores
  take it (the phase that holds the gradient collective less each rank's wait, and left out while
  the wait is not measured); without phase times, the rank with the longest step;
- the fastest: the rank with the fewest seconds per step in that phase (the shortest step without);
- rotating: the next ranks from the window's number (counted since the start) times their count,
  past the two above, so that over the windows every rank's steps are seen.

At most `limit` (`TelemetryConfig.trace_ranks`), the slowest first. `TraceSampling` decides per
window with `sample_ranks` (a pure function of the window's times: tests feed it timelines) and hands
the verdict, with the window's timeline it sealed when the window was scheduled, to a `TraceSink`
(the run's traces): that sends this rank's spans if it was sampled and, on the exporting rank,
returns the exemplar the step-time histogram carries (the slowest rank's slowest step).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torchtelemetry.report._values import Exemplar, HistogramValue, ReportValue
from torchtelemetry.report.signals._base import (
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)
from torchtelemetry.report.signals._data_wait import DATA_PHASE, DATA_WAIT
from torchtelemetry.report.signals._hang import COLLECT_PHASE
from torchtelemetry.report.signals._phases import PHASE
from torchtelemetry.report.signals._step_time import STEP_TIME, STEP_TIME_HISTOGRAM
from torchtelemetry.report.signals._stragglers import DEFAULT_SYNC_PHASE, phase_work
from torchtelemetry.report.signals._sync_wait import SYNC_WAIT
from torchtelemetry.report.signals._timeline import CHECKPOINT_SECTION, SYNC_WAIT_SECTION

__all__ = ["TraceSample", "TraceSampling", "TraceSink", "sample_ranks", "section_kinds"]


@dataclass(frozen=True, slots=True)
class TraceSample:
    """The ranks whose spans a window sends, the slowest first."""

    ranks: tuple[int, ...]

    @property
    def slowest(self) -> int:
        return self.ranks[0]


def section_kinds(phases: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds of section a run's timeline keeps: its phases in declared order (a phase's index is
    its kind), the data wait, the sync wait, the wait for a collection, a checkpoint."""
    return (*phases, DATA_PHASE, SYNC_WAIT_SECTION, COLLECT_PHASE, CHECKPOINT_SECTION)


def sample_ranks(
    times: Mapping[str, Mapping[int, float]],
    sync_wait: Mapping[int, float],
    sync_phase: str,
    step_times: Mapping[int, float],
    *,
    world_size: int,
    window: int,
    limit: int,
) -> TraceSample:
    """The ranks of window number `window` (see the module): `times[phase][rank]` and
    `step_times[rank]` in seconds per step, `sync_wait[rank]` the seconds per step waited for the
    gradient collective inside `sync_phase`."""
    slowest = fastest = None
    worst: tuple[float, int] | None = None
    for phase, raw in times.items():
        work = phase_work(phase, {rank: s for rank, s in raw.items() if s > 0}, sync_wait, sync_phase)
        if not work or len(work) < 2:
            continue
        high = highest_rank(work)
        excess = work[high] - statistics.median(s for rank, s in work.items() if rank != high)
        if worst is None or (excess, -high) > worst:
            worst, slowest, fastest = (excess, -high), high, lowest_rank(work)
    if slowest is None and step_times:
        slowest, fastest = highest_rank(step_times), lowest_rank(step_times)
    chosen = list(dict.fromkeys(rank for rank in (slowest, fastest) if rank is not None))[:limit]
    rotating = max(limit - len(chosen), 0)
    start = window * rotating
    for offset in range(world_size):
        if len(chosen) >= min(limit, world_size):
            break
        rank = (start + offset) % world_size
        if rank not in chosen:
            chosen.append(rank)
    return TraceSample(tuple(chosen))


class TraceSink(Protocol):
    """Where a window's verdict goes: the run's traces."""

    def window_sealed(self) -> Any:
        """Training thread, as a window is scheduled: what its trace needs of this moment (its
        timeline, the run and attempt)."""
        ...

    def window_judged(self, sealed: Any, sample: TraceSample) -> Exemplar | None:
        """Publishing thread, with the window's results: send this rank's spans if sampled; on the
        exporting rank, the exemplar of the slowest rank's slowest step (else None)."""
        ...


class TraceSampling(Signal):
    """Decides each window's traced ranks on every rank and hands the verdict to `sink`; puts the
    exemplar `sink` returns on `train/step_time/histogram`. Exports no name of its own."""

    name = "traces"

    def __init__(self, context: SignalContext, sink: TraceSink, limit: int) -> None:
        super().__init__(context)
        self._sink = sink
        self._limit = limit
        self._sync_phase = DEFAULT_SYNC_PHASE
        self._windows = 0

    def set_sync_phase(self, phase: str) -> None:
        """`phase` holds the gradient collective (`Telemetry.watch_gradient_sync(phase=)`): taken less
        the wait, as the straggler scores take it."""
        self._sync_phase = phase

    def host_values(self) -> Any:
        return self._sink.window_sealed()

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        prefix = f"{PHASE}/"
        times = {
            key[len(prefix) :]: finite_by_rank(value)
            for key, value in window.items()
            if key.startswith(prefix)
        }
        data = finite_by_rank(window.get(DATA_WAIT))
        if data:
            times[DATA_PHASE] = data
        sample = sample_ranks(
            times,
            finite_by_rank(window.get(SYNC_WAIT)),
            self._sync_phase,
            finite_by_rank(window.get(STEP_TIME)),
            world_size=self.context.world_size,
            window=self._windows,
            limit=self._limit,
        )
        self._windows += 1
        exemplar = self._sink.window_judged(timing.host.get(self.name), sample)
        histogram = window.get(STEP_TIME_HISTOGRAM)
        if exemplar is not None and isinstance(histogram, HistogramValue):
            window[STEP_TIME_HISTOGRAM] = dataclasses.replace(histogram, exemplar=exemplar)
