"""Phases: where each rank's step time goes (`with telemetry.phase("forward"): ...`).

Each declared phase is timed per rank (CUDA events on the current stream on a GPU, the host's
monotonic clock otherwise, see `_clock`), summed over the window and divided by its steps: seconds
per step. The data phase is the data wait (`Telemetry.data_wait()`, `step(data_time=)`), host time
on every device, exported per rank under its own name `train/data_wait`. Per window:

- `train/phase/<name>`: seconds per step, one series per rank (up to `max_rank_series` ranks);
- over ranks, labelled `phase`, at any world size: `train/phases/{min,median,max}` (seconds),
  `train/phases/{min,median,max}_rank` (rank ids, as values; the median's is the lower median's)
  and `train/phases/share` (percent of the window's wall time the median rank spent in the phase;
  nested phases overlap);
- the straggler scores of `_stragglers` (with the sync wait of `_sync_wait`; the phase that holds the
  gradient collective, "backward" unless `watch_gradient_sync(phase=)` names another, is left
  out of them in a multi-rank run that does not measure that wait).

A phase that no rank entered in a window is left out of that window's report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from torchtelemetry.metric import DEFAULT_STATE_DTYPE, Metric, MetricAccumulator, MetricKind, ReduceOp
from torchtelemetry.report._naming import InvalidMetricNameError, validate_path
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import (
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
    median,
    median_rank,
)
from torchtelemetry.report.signals._clock import HostClock, PhaseClock, PhaseTimer, TracedHostClock
from torchtelemetry.report.signals._data_wait import DATA_PHASE, DATA_WAIT
from torchtelemetry.report.signals._event_clock import EventClock
from torchtelemetry.report.signals._hang import HEARTBEAT_LABELS
from torchtelemetry.report.signals._stragglers import TOP_RANK, TOP_SCORE, StragglerScores
from torchtelemetry.report.signals._sync_wait import SYNC_WAIT
from torchtelemetry.report.signals._timeline import NO_SECTIONS, SectionLog

__all__ = ["DEFAULT_PHASES", "MEDIAN_RANK", "PhaseTimes", "Phases", "check_phase_names"]

DEFAULT_PHASES = ("forward", "backward", "optimizer")
"""`TelemetryConfig.phases` by default; a phase no rank enters costs its state, never a series."""
PHASE = "train/phase"
PHASES = "train/phases"
MEDIAN_RANK = f"{PHASES}/median_rank"


class PhaseTimes(Metric):
    """Seconds spent in each phase and the steps they cover, per rank: `(phases, world_size)` and
    `(world_size,)` sums in which each rank fills its own column (no extra collective).

    Rows follow the sorted phase names, whatever order they were declared in, so that ranks (and
    checkpoints) that declare the same phases in another order agree on every row; the names ride
    the layout check (`configuration()`)."""

    label_name = "rank"
    keyed_states: ClassVar[Mapping[str, str]] = {"seconds": "phases"}

    def __init__(self, world_size: int, rank: int, phases: Sequence[str]) -> None:
        super().__init__(unit="seconds", description="Seconds per step spent in the phase, per rank")
        self.rank = rank
        self.phases = tuple(sorted(phases))
        """The phase of each row of `seconds`."""
        self._rows = tuple(self.phases.index(name) for name in phases)
        """The row of each phase in declared order (the order `add()` takes seconds in)."""
        self.seconds = MetricAccumulator(
            torch.zeros(len(self.phases), world_size), ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE
        )
        self.steps = MetricAccumulator(torch.zeros(world_size), ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE)

    def add(self, seconds: Sequence[float], steps: int) -> None:
        """Add host seconds per phase (in declared order) covering `steps` steps to this rank's column
        (host numbers, staged with the window's other host values when bound; no sync)."""
        for row, value in zip(self._rows, seconds, strict=True):
            if value:
                self.seconds.add_at((row, self.rank), value)
        if steps:
            self.steps.add_at(self.rank, steps)

    def configuration(self) -> dict[str, Any]:
        """The phase names: ranks must declare the same ones (in any order)."""
        return {**super().configuration(), "phases": list(self.phases)}

    def compute(self) -> dict[str, torch.Tensor]:
        per_step = self.seconds.value / self.steps.value
        return dict(zip(self.phases, per_step.unbind(0), strict=True))  # one op, not one per phase


class Phases(Signal):
    """The phases of `TelemetryConfig.phases` and the data wait, with straggler scores."""

    name = "phases"
    event_names = frozenset({TOP_RANK, TOP_SCORE})

    def __init__(
        self,
        context: SignalContext,
        phases: Sequence[str],
        *,
        top_k: int = 3,
        clock: PhaseClock | None = None,
        log: SectionLog = NO_SECTIONS,
    ) -> None:
        """`log`: the window's timeline for its trace, whose first kinds are `phases` in order."""
        super().__init__(context)
        self.phases = check_phase_names(phases)
        self.times = PhaseTimes(context.world_size, context.rank, self.phases).to(context.device)
        if clock is None:
            clock = (
                EventClock(len(self.phases), context.device, log=log)
                if context.device.type == "cuda"
                else TracedHostClock(len(self.phases), log)
                if log.keeps
                else HostClock(len(self.phases))
            )
        self._clock = clock
        self._timers = {
            name: clock.timer(index, name) if isinstance(clock, HostClock) else PhaseTimer(clock, index, name)
            for index, name in enumerate(self.phases)
        }
        self._steps = 0
        self.stragglers = StragglerScores(top_k, warn=context.rank == 0)
        self._paths = tuple((name, f"{PHASE}/{name}") for name in self.phases)
        """Each phase and its metric path."""

    def timers(self) -> dict[str, PhaseTimer]:
        """The context manager of every declared phase."""
        return dict(self._timers)

    def set_sync_phase(self, phase: str) -> None:
        """`phase` holds the gradient collective (`Telemetry.watch_gradient_sync(phase=)`): its
        straggler scores are taken less the wait."""
        self.stragglers.sync_phase = phase

    def metrics(self) -> dict[str, Metric]:
        return {PHASE: self.times} if self.phases else {}

    def descriptors(self) -> list[MetricDescriptor]:
        out = []
        if self.context.per_rank_series:
            out += [
                MetricDescriptor(
                    f"{PHASE}/{name}", MetricKind.GAUGE, "seconds", self.times.description, "rank"
                )
                for name in self.phases
            ]

        def by_phase(stat: str, unit: str, description: str) -> MetricDescriptor:
            return MetricDescriptor(f"{PHASES}/{stat}", MetricKind.GAUGE, unit, description, "phase")

        out += [
            by_phase(stat, "seconds", f"{stat} over ranks of seconds per step")
            for stat in ("min", "median", "max")
        ]
        out += [
            by_phase(f"{stat}_rank", "", f"Rank with the {stat} seconds per step")
            for stat in ("min", "median", "max")
        ]
        out.append(by_phase("share", "percent", "Percent of the window's wall time the median rank spent"))
        return out + self.stragglers.descriptors()

    def on_step(self, step: int, step_time: float | None) -> None:
        self._steps += 1

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        for seconds, steps in self._clock.take(self._steps, wait=final):
            if self.phases:  # no phase: no window state to add to
                self.times.add(seconds, steps)
        self._steps = 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        times: dict[str, dict[int, float]] = {}
        per_rank_series = self.context.per_rank_series
        for name, key in self._paths:
            by_rank = finite_by_rank(window.get(key))
            entered = any(by_rank.values())
            if not per_rank_series or not entered:
                window.pop(key, None)
            if entered:
                times[name] = by_rank
        data = finite_by_rank(window.get(DATA_WAIT))
        if any(data.values()):
            times[DATA_PHASE] = data
        if not times:
            return
        stats: dict[str, dict[str, float]] = {
            stat: {} for stat in ("min", "median", "max", "min_rank", "median_rank", "max_rank", "share")
        }
        for name, by_rank in times.items():
            low, high = lowest_rank(by_rank), highest_rank(by_rank)
            stats["min"][name], stats["min_rank"][name] = by_rank[low], float(low)
            stats["max"][name], stats["max_rank"][name] = by_rank[high], float(high)
            stats["median"][name] = median(by_rank)
            stats["median_rank"][name] = float(median_rank(by_rank))
            if timing.duration_s > 0 and timing.steps > 0:
                stats["share"][name] = 100 * stats["median"][name] * timing.steps / timing.duration_s
        window.update({f"{PHASES}/{stat}": values for stat, values in stats.items() if values})
        step_s = timing.duration_s / timing.steps if timing.duration_s > 0 and timing.steps > 0 else 0.0
        window.update(self.stragglers.score(times, step_s, finite_by_rank(window.get(SYNC_WAIT))))

    def state_dict(self) -> dict[str, Any]:
        return {"own_best": self.stragglers.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stragglers.load_state_dict(state.get("own_best", {}))

    def close(self) -> None:
        self._clock.close()


def check_phase_names(phases: Sequence[str]) -> tuple[str, ...]:
    """`phases` as a tuple, each a legal single path segment, none twice, not the data phase nor a
    label of the heartbeat's own (`HEARTBEAT_LABELS`)."""
    if isinstance(phases, str):
        raise TypeError(f"TelemetryConfig.phases must be a sequence of names, got the string {phases!r}")
    names = tuple(phases)
    for name in names:
        if not isinstance(name, str) or "/" in name:
            raise ValueError(f"TelemetryConfig.phases: {name!r} must be one path segment (no '/')")
        try:
            validate_path(name)
        except InvalidMetricNameError as error:
            raise InvalidMetricNameError(f"TelemetryConfig.phases: {error}") from None
    if DATA_PHASE in names:
        raise ValueError(
            f"TelemetryConfig.phases: {DATA_PHASE!r} is the data wait, timed by Telemetry.data_wait() "
            "(also as phase('data')); leave it out"
        )
    reserved = sorted(set(names) & set(HEARTBEAT_LABELS))
    if reserved:
        raise ValueError(
            f"TelemetryConfig.phases: {reserved} are labels of the hang heartbeat's own "
            f"({', '.join(HEARTBEAT_LABELS)}: not in a phase, waiting for a window's collection, "
            "closed, unknown), so a hang report could not tell your phase from them; rename it "
            "(e.g. 'collect_rollouts')"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"TelemetryConfig.phases: names repeat in {names}")
    return names
