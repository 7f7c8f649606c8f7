"""Which ranks a window's trace comes from: exact verdicts of `sample_ranks` on synthetic timelines of
synchronous data parallel (seconds per step per rank and phase, the sync wait), and the signal that
hands them, with the window's timeline, to the run's traces."""

from __future__ import annotations

from typing import Any

import pytest

from tests.report.windows import context
from torchtelemetry.report import Exemplar, HistogramValue, TraceSample, WindowTiming, sample_ranks
from torchtelemetry.report.signals import STEP_TIME_HISTOGRAM, TraceSampling

WORK = {"data": 0.002, "forward": 0.010, "backward": 0.020, "optimizer": 0.005}
"""A healthy rank's seconds per step in each phase (backward without its wait)."""


def synchronous(world_size: int, slow: int | None = None, phase: str = "forward", delay: float = 0.1):
    """One window of synchronous DDP: `slow` spends `delay` more per step in `phase`, and every other
    rank waits that long in the backward's all-reduce (which the slow rank reaches last, so it waits
    least). Returns (times by phase and rank, sync wait by rank, step time by rank)."""
    times = {name: dict.fromkeys(range(world_size), seconds) for name, seconds in WORK.items()}
    wait = dict.fromkeys(range(world_size), 0.001)
    if slow is not None:
        times[phase][slow] += delay
        for rank in range(world_size):
            if rank != slow:
                wait[rank] += delay
    for rank in range(world_size):
        times["backward"][rank] += wait[rank]
    step = sum(WORK.values()) + (delay if slow is not None else 0.0) + 0.001
    return times, wait, dict.fromkeys(range(world_size), step)


def verdict(times, wait, steps, *, world_size: int, window: int = 0, limit: int = 3, sync: str = "backward"):
    return sample_ranks(times, wait, sync, steps, world_size=world_size, window=window, limit=limit).ranks


@pytest.mark.parametrize("phase", ["data", "forward", "optimizer", "backward"])
@pytest.mark.parametrize(("world_size", "expected"), [(2, (1, 0)), (4, (3, 1, 2)), (64, (63, 1, 5))])
def test_the_slow_rank_comes_first_in_any_phase_never_a_rank_that_waits(
    world_size: int, expected: tuple[int, ...], phase: str
) -> None:
    """The slowest, then the fastest in the slow rank's phase (rank 1, where there are more than 2),
    then the rotating rank of window 5: rank 5 of 64, and of 4 ranks the next after rank 1 (5 % 4)."""
    times, wait, steps = synchronous(world_size, world_size - 1, phase)
    if world_size > 2:
        times[phase][1] -= 0.001
    assert verdict(times, wait, steps, world_size=world_size, window=5) == expected


def test_without_the_wait_the_phase_holding_the_collective_names_nobody() -> None:
    """Rank 2 is slow in its forward; the others' backward is long with the wait. Without the wait,
    the backward is left out (it would name a rank that waits): the forward decides."""
    times, _, steps = synchronous(4, 2, "forward")
    assert verdict(times, {}, steps, world_size=4)[0] == 2
    times["forward"][2] = WORK["forward"]  # nothing slow but the wait itself: the backward is not read
    assert verdict(times, {}, steps, world_size=4)[0] == 0  # the forward's highest, on ties the lowest


def test_the_sync_phase_follows_watch_gradient_sync() -> None:
    """Rank 1's optimizer step holds the collective (`phase="optimizer"`) and it arrives last."""
    times, wait, steps = synchronous(4, 1, "forward")
    assert verdict(times, wait, steps, world_size=4, sync="backward")[0] == 1
    for rank in range(4):  # the others' wait lands in the optimizer step instead
        times["optimizer"][rank] += times["backward"][rank] - WORK["backward"]
        times["backward"][rank] = WORK["backward"]
    assert verdict(times, wait, steps, world_size=4, sync="optimizer")[0] == 1


def test_without_phase_times_the_step_times_decide() -> None:
    steps = {0: 1.0, 1: 1.5, 2: 0.9, 3: 1.0}
    assert verdict({}, {}, steps, world_size=4, window=0) == (1, 2, 0)


def test_the_rotating_rank_goes_through_the_world_and_the_limit_holds() -> None:
    times, wait, steps = synchronous(8, 7, "forward")
    times["forward"][0] -= 0.001
    rotating = [verdict(times, wait, steps, world_size=8, window=window)[2] for window in range(8)]
    # From the window's number, past the slowest (7) and the fastest (0): every rank once in 8 windows.
    assert rotating == [1, 1, 2, 3, 4, 5, 6, 1]
    assert verdict(times, wait, steps, world_size=8, limit=1) == (7,)
    assert verdict(times, wait, steps, world_size=8, limit=2) == (7, 0)
    assert verdict(times, wait, steps, world_size=8, window=1, limit=5) == (7, 0, 3, 4, 5)
    assert verdict(times, wait, steps, world_size=8, limit=20) == (7, 0, 1, 2, 3, 4, 5, 6)
    assert verdict({}, {}, {}, world_size=1) == (0,)


def test_sixteen_thousand_ranks_send_from_three() -> None:
    world_size = 16384
    times, wait, steps = synchronous(world_size, 12345, "optimizer")
    ranks = verdict(times, wait, steps, world_size=world_size, window=3)
    assert len(ranks) == 3 and ranks[0] == 12345


class Sink:
    """The run's side, recording what the signal hands over."""

    def __init__(self, exemplar: Exemplar | None) -> None:
        self.exemplar = exemplar
        self.sealed = 0
        self.judged: list[tuple[Any, TraceSample]] = []

    def window_sealed(self) -> Any:
        self.sealed += 1
        return f"timeline {self.sealed}"

    def window_judged(self, sealed: Any, sample: TraceSample) -> Exemplar | None:
        self.judged.append((sealed, sample))
        return self.exemplar


def test_the_signal_samples_each_window_and_puts_the_exemplar_on_the_step_time_histogram() -> None:
    exemplar = Exemplar(value=0.3, timestamp=1.0, trace_id="ab" * 16, span_id="cd" * 8)
    sink = Sink(exemplar)
    signal = TraceSampling(context(world_size=4), sink, 3)
    signal.set_sync_phase("backward")
    histogram = HistogramValue((0.1, 1.0), (0.0, 4.0, 0.0), 1.2, 4.0)
    times, wait, steps = synchronous(4, 3, "forward")
    window: dict[str, Any] = {
        **{f"train/phase/{name}": {str(r): s for r, s in by_rank.items()} for name, by_rank in times.items()},
        "train/sync_wait": {str(r): s for r, s in wait.items()},
        "train/step_time": {str(r): s for r, s in steps.items()},
        STEP_TIME_HISTOGRAM: histogram,
    }
    window["train/data_wait"] = window.pop("train/phase/data")
    host = {signal.name: signal.host_values()}
    signal.derive(window, WindowTiming(step=9, timestamp=0.0, duration_s=1.0, steps=10, host=host))
    ((sealed, sample),) = sink.judged
    assert sealed == "timeline 1" and sample.ranks[0] == 3 and len(sample.ranks) == 3
    assert window[STEP_TIME_HISTOGRAM] == HistogramValue((0.1, 1.0), (0.0, 4.0, 0.0), 1.2, 4.0, exemplar)
    assert window[STEP_TIME_HISTOGRAM].exemplar_bucket() == 1
    sink.exemplar = None  # a rank that does not export: the histogram stays as it was
    window[STEP_TIME_HISTOGRAM] = histogram
    signal.derive(window, WindowTiming(step=19, timestamp=0.0, duration_s=1.0, steps=10, host=host))
    assert window[STEP_TIME_HISTOGRAM] is histogram
    assert [sample.ranks[2] for _, sample in sink.judged] == [1, 1]  # windows 0 and 1: from rank 0, 1
