"""Phases: per-rank seconds per step, over-rank statistics with rank ids as values, shares, clocks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.distributed import run_ranks
from tests.report.windows import collect_window, context
from torchtelemetry.report.signals import EventClock, HostTimer, Phases, SignalSet

DEVICE_MS = [0.0]
"""The fake device's clock (milliseconds), advanced by the tests."""


class FakeEvent:
    """A timing event of a fake device: records the device clock; `synchronize` waits on `gate`."""

    made = 0
    gate = threading.Event()

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.at: float | None = None

    def record(self) -> None:
        self.at = DEVICE_MS[0]

    def synchronize(self) -> None:
        assert FakeEvent.gate.wait(30)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def _device_work(ms: float) -> None:
    DEVICE_MS[0] += ms


def _event_phases(**kwargs) -> Phases:
    clock = EventClock(3, context().device, make_event=FakeEvent)
    return Phases(context(**kwargs), ("forward", "backward", "optimizer"), clock=clock)


def test_seconds_per_step_over_ranks_and_shares_exported_only_for_phases_entered() -> None:
    FakeEvent.gate.set()
    phases = _event_phases()
    signals = SignalSet([phases])
    for step in range(2):
        with phases.timers()["forward"]:
            _device_work(10)
        with phases.timers()["backward"]:
            _device_work(20)
            with phases.timers()["forward"]:  # nested in another phase: both blocks count
                _device_work(5)
        signals.record_step(step, None, {})
    window = collect_window(signals, step=1, steps=2, duration_s=0.1)
    signals.close()
    assert window["train/phase/forward"] == {"0": pytest.approx(0.015)}
    assert window["train/phase/backward"] == {"0": pytest.approx(0.025)}
    assert "train/phase/optimizer" not in window  # declared, never entered
    assert window["train/phases/median"] == {
        "forward": pytest.approx(0.015),
        "backward": pytest.approx(0.025),
    }
    assert (
        window["train/phases/min_rank"]
        == window["train/phases/max_rank"]
        == {"forward": 0.0, "backward": 0.0}
    )
    # percent of the window's 0.1 s wall time: 2 steps x 15 ms, 2 x 25 ms
    assert window["train/phases/share"] == {"forward": pytest.approx(30.0), "backward": pytest.approx(50.0)}
    # A world of one: no other rank to score against, only against its own best.
    assert "train/straggler/score" not in window and "train/straggler/top_rank" not in window
    assert window["train/straggler/own_best_score"] == {"forward": 1.0, "backward": 1.0}


def test_event_clock_reads_events_off_the_training_thread_and_a_window_carries_what_completed() -> None:
    FakeEvent.gate.clear()  # the device has not reached the events yet
    FakeEvent.made = 0
    phases = _event_phases()
    signals = SignalSet([phases])
    for step in range(3):
        with phases.timers()["forward"]:
            _device_work(10)
        signals.record_step(step, None, {})
    first = collect_window(signals, step=2, steps=3, final=False)  # handed to the reader, not read
    assert "train/phase/forward" not in first and "train/phases/median" not in first
    FakeEvent.gate.set()
    with phases.timers()["forward"]:
        _device_work(40)
    signals.record_step(3, None, {})
    second = collect_window(signals, step=3, steps=1, final=True)  # waits for both batches
    # 3 steps of 10 ms and 1 of 40 ms, each batch with the steps it covers
    assert second["train/phase/forward"] == {"0": pytest.approx(0.07 / 4)}
    for step in range(4, 40):
        with phases.timers()["forward"]:
            _device_work(1)
        signals.record_step(step, None, {})
        collect_window(signals, step=step, final=True)
    signals.close()
    assert FakeEvent.made <= 8, "events are pooled and reused once read"


def test_the_host_clock_times_blocks_and_undeclared_phases_are_refused() -> None:
    phases = Phases(context(), ("forward",))
    signals = SignalSet([phases])
    with phases.timers()["forward"]:
        time.sleep(0.02)
    signals.record_step(0, None, {})
    window = collect_window(signals, duration_s=0.05)
    assert window["train/phase/forward"]["0"] >= 0.02
    with pytest.raises(ValueError, match=r"'fwd' is not a declared phase.*\('forward',\)"):
        signals.phase("fwd")


def test_a_phase_entered_again_inside_itself_counts_once() -> None:
    FakeEvent.gate.set()
    phases = _event_phases()
    signals = SignalSet([phases])
    with phases.timers()["forward"]:
        _device_work(10)
        with phases.timers()["forward"]:  # e.g. a model whose submodule times its own forward
            _device_work(10)
            with phases.timers()["forward"]:
                _device_work(5)
        with phases.timers()["backward"]:  # another phase nested in it still counts on its own
            _device_work(5)
    signals.record_step(0, None, {})
    window = collect_window(signals, duration_s=0.05)
    signals.close()
    assert window["train/phase/forward"] == {"0": pytest.approx(0.03)}
    assert window["train/phase/backward"] == {"0": pytest.approx(0.005)}
    assert window["train/phases/share"]["forward"] == pytest.approx(60.0)


def test_a_data_wait_entered_again_inside_itself_is_one_wait() -> None:
    waits: list[float] = []
    timer = HostTimer(waits.append)
    with timer:
        with timer:
            pass
        with timer:
            pass
    assert len(waits) == 1


@pytest.mark.parametrize("section", ["phase", "data_wait"])
def test_a_phase_or_data_wait_entered_on_another_thread_is_refused_naming_it(section: str) -> None:
    import torchtelemetry as tt

    telemetry = tt.Telemetry({"train": {"loss": tt.WeightedMeanMetric()}}, [], every=2)
    timer = telemetry.phase("forward") if section == "phase" else telemetry.data_wait()
    errors: list[BaseException] = []

    def prefetch() -> None:
        try:
            with telemetry.phase("data") if section == "data_wait" else telemetry.phase("forward"):
                pass
        except RuntimeError as error:
            errors.append(error)
        try:
            with timer:  # a timer made on the training thread, entered here
                pass
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=prefetch, name="prefetch-0")
    thread.start()
    thread.join()
    assert len(errors) == 2
    for error in errors:
        assert "thread 'prefetch-0'" in str(error) and "MainThread" in str(error)
    with timer:  # the training thread still times it, nothing of the refused blocks counted
        pass
    telemetry.step(0)
    telemetry.close()
    key = "train/phase/forward" if section == "phase" else "train/data_wait"
    assert set(telemetry.latest[key]) == {"0"}


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (("data",), "'data' is the data wait"),
        (("a/b",), "one path segment"),
        (("a", "a"), "names repeat"),
        ("forward", "a sequence of names"),
        (("",), r"TelemetryConfig.phases: .*must be a non-empty string"),
    ],
)
def test_phase_names_are_checked(names, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        Phases(context(), names)


def _two_ranks_one_slow(rank: int, world_size: int, max_rank_series: int) -> dict:
    phases = Phases(context(world_size, rank, max_rank_series), ("forward", "backward"))
    signals = SignalSet([phases])
    for step in range(2):
        with phases.timers()["forward"]:
            time.sleep(0.06 if rank == 1 else 0.01)
        with phases.timers()["backward"]:
            time.sleep(0.01)
        signals.record_step(step, None, {})
    window = collect_window(signals, step=1, steps=2, duration_s=0.2)
    signals.close()
    return window


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_rank_series", [64, 0])
def test_two_ranks_name_the_slow_rank_in_its_phase_as_values(max_rank_series: int) -> None:
    windows = run_ranks(_two_ranks_one_slow, 2, max_rank_series)
    window = windows[0]
    assert window == windows[1], "every rank derives the same report"
    assert window["train/phases/max_rank"]["forward"] == 1.0
    assert window["train/phases/min_rank"]["forward"] == 0.0
    assert window["train/straggler/rank"]["forward"] == 1.0
    assert window["train/phases/max"]["forward"] >= 0.06 > window["train/phases/min"]["forward"] >= 0.01
    if max_rank_series:
        assert set(window["train/phase/forward"]) == {"0", "1"}
    else:  # above the per-rank series limit: values over ranks only
        assert not any(name.startswith("train/phase/") for name in window)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_phases_time_the_device_with_no_host_sync_on_the_training_thread() -> None:
    import torchtelemetry as tt

    device = torch.device("cuda")
    loss = tt.WeightedMeanMetric().to(device)
    telemetry = tt.Telemetry({"train": {"loss": loss}}, [], every=4, phases=("forward", "backward"))
    weight = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for step in range(8):
            with telemetry.phase("forward"):
                out = weight @ weight
            with telemetry.phase("backward"):
                out = out.relu()
            loss.update(out.mean(), 1)  # counted by the sentinel on the device
            telemetry.step(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    telemetry.close()
    latest = telemetry.latest
    assert latest["train/phases/median"]["forward"] > latest["train/phases/median"]["backward"] > 0
    assert latest["train/nonfinite/count"] == {"train/loss": 0.0}


def test_a_host_clocks_timers_add_to_the_window_being_timed_after_each_take() -> None:
    """A host clock's phase timers add to the clock's seconds themselves (no call per block): what a
    window took stays as it was, and the next blocks go to the next window. A traced clock's timers
    call its `stop`, which logs each section too."""
    from torchtelemetry.report.signals import (
        HostClock,
        HostPhaseTimer,
        PhaseTimer,
        SectionLog,
        TracedHostClock,
    )

    traced = TracedHostClock(1, SectionLog(("forward",)))
    assert type(traced.timer(0, "forward")) is PhaseTimer

    clock = HostClock(2)
    backward = clock.timer(1, "backward")
    assert isinstance(backward, HostPhaseTimer)
    with backward:
        time.sleep(0.001)
    ((first, steps),) = clock.take(1)
    assert steps == 1 and first[0] == 0.0 and first[1] >= 0.001
    taken = list(first)
    with backward:
        time.sleep(0.001)
    ((second, _),) = clock.take(1)
    assert first == taken  # a window's seconds are its own
    assert second[0] == 0.0 and second[1] >= 0.001
    assert clock.take(1) == [([0.0, 0.0], 1)]
