"""A window's spans from its timeline, their ids derived from (run, attempt, rank, step), and the
exemplar the exporting rank derives for another rank's step: pure functions of the recorded times."""

from __future__ import annotations

import torch

from tests.report.test_timeline import KINDS
from torchtelemetry.report import SectionLog, TraceSample
from torchtelemetry.run import (
    RunTraces,
    TracedWindow,
    hex_span_id,
    hex_trace_id,
    span_id,
    trace_id,
    window_spans,
)

OFFSET_S = 1_700_000_000.0
"""Unix time at `perf_counter()` 0 in these timelines."""


def _window(log: SectionLog, run_id: str = "run-1", attempt: int = 2) -> TracedWindow:
    sealed = log.seal()
    assert sealed is not None
    return TracedWindow(sealed, run_id, attempt, phases=3, wall_offset_s=OFFSET_S)


def _timeline() -> SectionLog:
    """Two steps: data, forward, backward (with its sync wait), then a checkpoint made durable in the
    second step, taken in the first."""
    log = SectionLog(KINDS, since=0.0)
    log.record(2, 0.0, 0.1)  # data
    log.record(0, 0.1, 0.3)  # forward
    log.record(3, 0.5, 0.6)  # sync wait, handed over at the flush
    log.record(1, 0.3, 0.6)  # backward
    log.stepped(10, 0.7)
    log.record(0, 0.8, 1.0)
    log.record(5, 0.65, 1.1)  # checkpoint: state_dict() at the end of step 10, durable in step 11
    log.stepped(11, 1.2)
    return log


def test_one_step_span_per_step_and_a_child_per_section_each_in_the_step_it_ended() -> None:
    spans = window_spans(_window(_timeline()), rank=3)
    roots = [span for span in spans if span.parent_id is None]
    assert [(span.name, span.attributes["torchtelemetry.step"]) for span in roots] == [
        ("train.step", 10),
        ("train.step", 11),
    ]
    ns = lambda seconds: round((seconds + OFFSET_S) * 1e9)  # noqa: E731
    assert [(span.start_ns, span.end_ns) for span in roots] == [(ns(0.0), ns(0.7)), (ns(0.7), ns(1.2))]
    children = {root.span_id: [s for s in spans if s.parent_id == root.span_id] for root in roots}
    first, second = (children[root.span_id] for root in roots)
    assert [s.name for s in first] == ["train.data", "train.forward", "train.sync_wait", "train.backward"]
    assert [s.name for s in second] == ["train.forward", "train.checkpoint"]
    assert [(s.start_ns, s.end_ns) for s in second] == [(ns(0.8), ns(1.0)), (ns(0.65), ns(1.1))]
    for span in spans:
        assert span.trace_id == next(r.trace_id for r in roots if span in (r, *children[r.span_id]))
        expected = {
            "torchtelemetry.run_id": "run-1",
            "torchtelemetry.attempt": 2,
            "torchtelemetry.rank": 3,
            "torchtelemetry.step": span.attributes["torchtelemetry.step"],
        }
        phase = span.name.removeprefix("train.")
        if phase in ("data", "forward", "backward"):
            expected["torchtelemetry.phase"] = phase
        assert span.attributes == expected
    assert len({span.span_id for span in spans}) == len(spans)


def test_ids_come_from_run_attempt_rank_and_step_alone() -> None:
    spans = window_spans(_window(_timeline()), rank=3)
    root = spans[0]
    assert root.trace_id == trace_id("run-1", 2, 3, 10) and root.span_id == span_id(
        root.trace_id, "train.step"
    )
    again = window_spans(_window(_timeline()), rank=3)
    assert [(s.trace_id, s.span_id) for s in again] == [(s.trace_id, s.span_id) for s in spans]
    others = {
        trace_id("run-2", 2, 3, 10),
        trace_id("run-1", 3, 3, 10),
        trace_id("run-1", 2, 4, 10),
        trace_id("run-1", 2, 3, 11),
    }
    assert root.trace_id not in others and len(others) == 4
    assert len(hex_trace_id(1)) == 32 and len(hex_span_id(1)) == 16


def test_sections_outside_the_windows_steps_and_past_a_full_log_are_left_out() -> None:
    log = SectionLog(KINDS, capacity=2, since=0.0)
    log.record(0, -0.5, -0.1)  # ended before the window's first step began: not this window's
    log.record(0, 0.1, 0.2)
    log.stepped(0, 0.5)
    log.record(0, 0.6, 0.7)  # past the capacity: lost
    log.stepped(1, 1.0)
    spans = window_spans(_window(log), rank=0)
    assert [(s.name, s.attributes["torchtelemetry.step"]) for s in spans] == [
        ("train.step", 0),
        ("train.forward", 0),
    ]  # step 1 lost its sections: not sent as if it had none


def test_the_exporting_rank_links_the_slowest_ranks_trace_of_its_slowest_step() -> None:
    traces = RunTraces(
        ("forward", "backward"),
        rank=0,
        world_size=4,
        exporting=True,
        run_id="run-1",
        sender=None,
        trace_ranks=0,
        device=torch.device("cpu"),
    )
    exemplar = traces.window_judged(_window(_timeline()), TraceSample((3, 1, 2)))
    assert exemplar is not None
    assert exemplar.trace_id == hex_trace_id(trace_id("run-1", 2, 3, 10))  # step 10 took 0.7 s, 11 0.5 s
    assert exemplar.span_id == hex_span_id(span_id(trace_id("run-1", 2, 3, 10), "train.step"))
    assert exemplar.value == 0.7 and exemplar.timestamp == 0.7 + OFFSET_S
    assert traces.window_judged(None, TraceSample((3,))) is None  # traces off: no timeline, no exemplar
