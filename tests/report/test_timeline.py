"""A window's timeline for its trace: the times the timers take anyway, kept in lists made once, handed
over when the window is scheduled; CUDA events placed on the host timeline by the clock's reader."""

from __future__ import annotations

import time

import pytest
import torch

from tests.report.windows import context
from torchtelemetry.report.signals import (
    DataWait,
    EventClock,
    HostAnchor,
    PhaseTimer,
    SectionLog,
    SyncWait,
    TracedHostClock,
    section_kinds,
)

KINDS = section_kinds(("forward", "backward"))


def test_kinds_are_the_phases_then_the_runs_own_sections_and_a_phase_keeps_its_name() -> None:
    assert KINDS == ("forward", "backward", "data", "sync_wait", "collect", "checkpoint")
    log = SectionLog(section_kinds(("forward", "checkpoint")))
    assert log.kind("checkpoint") == 5 and log.kinds[1] == "checkpoint"  # the run's, after the phase


def test_a_window_hands_over_its_steps_and_sections_and_the_next_starts_at_its_last_step() -> None:
    log = SectionLog(KINDS)
    since = log.seal().since  # an empty window: nothing but where the next begins
    log.record(0, 1.0, 2.0)
    log.stepped(7, 2.5)
    log.record(1, 2.6, 3.0)
    log.stepped(8, 3.5)
    log.record(4, 3.6, 3.7)  # a wait for the collection inside the step() that scheduled the window
    window = log.seal()
    assert window.since == since and window.steps == [7, 8] and window.step_ends == [2.5, 3.5]
    assert window.sections == [(0, 1.0, 2.0), (1, 2.6, 3.0)] and window.complete_steps is None
    log.stepped(9, 4.0)
    following = log.seal()
    assert following.since == 3.5 and following.sections == [(4, 3.6, 3.7)] and following.steps == [9]


def test_the_log_is_bounded_and_says_when_a_window_lost_sections() -> None:
    log = SectionLog(KINDS, capacity=3, max_steps=2)
    for step in range(4):
        log.record(0, step, step + 0.5)
        log.record(1, step + 0.5, step + 0.9)
        log.stepped(step, step + 1.0)
    window = log.seal()
    assert window.steps == [0, 1] and len(window.sections) == 3
    assert window.complete_steps == 1  # step 1 lost its backward
    nothing = SectionLog(KINDS, capacity=0)
    nothing.record(0, 1.0, 2.0)
    nothing.stepped(0, 2.0)
    assert not nothing.keeps and nothing.seal() is None and nothing.late() is None


def test_the_traced_host_timers_hand_the_times_they_take_to_the_log() -> None:
    log = SectionLog(KINDS)
    clock = TracedHostClock(2, log)
    forward, backward = PhaseTimer(clock, 0, "forward"), PhaseTimer(clock, 1, "backward")
    data = DataWait(context(), log)
    for step in range(3):
        with data.timers()["data"]:
            time.sleep(0.001)
        with forward, backward:
            time.sleep(0.002)
        data.on_step(step, None)
        log.stepped(step, time.perf_counter())
    window = log.seal()
    ((seconds, _),) = clock.take(3)
    for kind in (0, 1):
        recorded = [end - start for k, start, end in window.sections if k == kind]
        assert len(recorded) == 3 and sum(recorded) == seconds[kind]  # the phase times, exactly
    assert [k for k, _, _ in window.sections] == [2, 1, 0] * 3  # the order they ended in
    data.flush(1.0)
    waited = sum(end - start for k, start, end in window.sections if k == 2)
    assert data.wait.compute()[0].item() * 3 == pytest.approx(waited, rel=1e-12)


def test_the_sync_wait_goes_to_the_log_at_the_windows_flush() -> None:
    log = SectionLog(KINDS)
    wait = SyncWait(context(), log)
    model = torch.nn.Linear(4, 1)
    wait.watch_gradient_sync(model)
    model(torch.ones(2, 4)).sum().backward()  # no collective: the wait is the engine's bookkeeping
    assert log.seal().sections == []  # not yet handed over
    wait.on_step(0, None)
    wait.flush(1.0)
    ((kind, start, end),) = log.seal().sections
    assert kind == KINDS.index("sync_wait") and start <= end
    assert wait.wait.compute()[0].item() == pytest.approx(end - start, rel=1e-12)
    wait.close()


class HostClockEvent:
    """A timing event whose device clock is the host's `perf_counter`: placed times can be checked."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self, stream: object = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: HostClockEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000


def test_an_anchor_places_completed_events_on_the_host_timeline() -> None:
    event = HostClockEvent()
    event.record()
    before = time.perf_counter()
    anchor = HostAnchor(HostClockEvent())
    assert before <= anchor.host_time <= time.perf_counter()
    assert anchor.place(event) == pytest.approx(event.at, abs=(anchor.host_time - before) + 1e-6)


def test_the_event_clocks_reader_places_a_windows_phases_and_hands_them_to_it() -> None:
    log = SectionLog(KINDS)
    clock = EventClock(2, context().device, make_event=HostClockEvent, log=log)
    timer = PhaseTimer(clock, 1, "backward")
    entered = time.perf_counter()
    with timer:
        time.sleep(0.01)
    left = time.perf_counter()
    clock.take(1, wait=True)
    (late,) = log.seal().late
    assert late.wait(30)
    ((kind, start, end),) = late.sections
    assert kind == 1 and entered - 1e-3 <= start < end <= left + 1e-3 and end - start >= 0.01
    clock.close()
