"""A window's spans from its timeline: one `train.step` span per step, a child per timed section.

A step's span runs from the previous step's end (`Telemetry.step()`; for the window's first, the
previous window's last, or the start of the timeline) to its own; its trace is its own (see
`_trace_ids`). A section belongs to the step during which it ended: a phase, the data wait, the sync
wait and a wait for a collection lie within it; a checkpoint's span starts when `state_dict()` was
taken for it, often steps earlier. The times are the host's `perf_counter` seconds the timers took
(CUDA events already placed on that timeline), turned into Unix nanoseconds by one offset. Every
span carries the run id, attempt, rank and step; a phase's (the data wait included) its phase.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from torchtelemetry.export import SpanRecord
from torchtelemetry.report import (
    ATTEMPT_ATTRIBUTE,
    PHASE_ATTRIBUTE,
    RANK_ATTRIBUTE,
    RUN_ID_ATTRIBUTE,
    STEP_ATTRIBUTE,
    STEP_SPAN,
    WindowSections,
    span_name,
)
from torchtelemetry.run._trace_ids import span_id, trace_id

__all__ = ["TracedWindow", "window_spans"]


@dataclass(frozen=True, slots=True)
class TracedWindow:
    """A window's timeline, with the run and attempt it was trained in and the host's clock offset."""

    sections: WindowSections
    run_id: str
    attempt: int
    phases: int
    """How many of the first kinds of section are phases (the declared ones and the data wait)."""
    wall_offset_s: float
    """Unix time minus `perf_counter()`."""


def window_spans(
    window: TracedWindow, rank: int, extra: Sequence[tuple[int, float, float]] = ()
) -> list[SpanRecord]:
    """The spans of `window` on `rank`: its host-timed sections and `extra` ones (placed CUDA events),
    each given to the step during which it ended (sections outside the window's steps are left out)."""
    timeline = window.sections
    ends = timeline.step_ends
    if timeline.complete_steps is not None:  # later steps lost sections past the log's capacity
        ends = ends[: timeline.complete_steps]
    starts = [timeline.since, *ends[:-1]]
    by_step: list[list[tuple[int, float, float]]] = [[] for _ in ends]
    for section in sorted((*timeline.sections, *extra), key=lambda section: section[2]):
        index = bisect.bisect_left(ends, section[2])
        if index < len(ends) and section[2] >= starts[index]:
            by_step[index].append(section)

    def ns(seconds: float) -> int:
        return round((seconds + window.wall_offset_s) * 1e9)

    spans = []
    for step, start, end, sections in zip(timeline.steps, starts, ends, by_step, strict=False):
        trace = trace_id(window.run_id, window.attempt, rank, step)
        root = span_id(trace, STEP_SPAN)
        attributes = {
            RUN_ID_ATTRIBUTE: window.run_id,
            ATTEMPT_ATTRIBUTE: window.attempt,
            RANK_ATTRIBUTE: rank,
            STEP_ATTRIBUTE: step,
        }
        spans.append(SpanRecord(STEP_SPAN, trace, root, None, ns(start), ns(end), attributes))
        for ordinal, (kind, began, ended) in enumerate(sections, start=1):
            section = timeline.kinds[kind]
            name = span_name(section)
            phase = {PHASE_ATTRIBUTE: section} if kind < window.phases else {}
            spans.append(
                SpanRecord(
                    name,
                    trace,
                    span_id(trace, name, ordinal),
                    root,
                    ns(began),
                    ns(ended),
                    attributes | phase,
                )
            )
    return spans
