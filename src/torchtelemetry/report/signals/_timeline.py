"""A window's timeline: when each timed section of the training thread began and ended, kept for the
window's trace (`torchtelemetry.run`'s traces turn it into spans, off the training thread).

The training thread hands over host times its timers take anyway (`time.perf_counter()`): a phase's
(`HostClock`), the data wait's (`HostTimer`), each step's end (`Telemetry.step()`), a wait for a
window's collection, a checkpoint made durable; the sync wait's times are handed over at the window's
flush. Nothing is allocated per section: `SectionLog` writes into lists made once, up to `capacity`
sections and `max_steps` steps a window (past either, the window's trace stops there; the phase times
exported are not affected). With capacity 0 (traces off) it keeps nothing.

On CUDA the phases are timed by events on the device: the clock's reader thread places them on the
host timeline (`HostAnchor`) once they completed and hands them over as the window's `LateSections`;
the sync wait's events go to the window as they are, placed by the thread that builds the spans.
`seal()` closes the window (when it is scheduled) and returns its `WindowSections`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECKPOINT_SECTION",
    "DEFAULT_MAX_STEPS",
    "DEFAULT_SECTIONS",
    "HostAnchor",
    "LateSections",
    "NO_SECTIONS",
    "SYNC_WAIT_SECTION",
    "Section",
    "SectionLog",
    "WindowSections",
]

SYNC_WAIT_SECTION = "sync_wait"
"""The section a backward waits for the gradient collective (`Telemetry.watch_gradient_sync`)."""
CHECKPOINT_SECTION = "checkpoint"
"""From `Telemetry.state_dict()` for a step to `checkpoint_saved(step)`."""
DEFAULT_SECTIONS = 4096
"""Sections a window keeps at most (a step with 4 sections: 1,024 steps)."""
DEFAULT_MAX_STEPS = 512
"""Steps a window keeps at most."""

Section = tuple[int, float, float]
"""(kind, start, end): the kind's index in `SectionLog.kinds`, host `perf_counter` seconds."""


class LateSections:
    """Sections of a window whose times are known only later (CUDA events read by another thread):
    `add` them, then `finish()`; `wait()` for that, bounded."""

    def __init__(self) -> None:
        self.sections: list[Section] = []
        self._finished = threading.Event()

    def add(self, kind: int, start: float, end: float) -> None:
        self.sections.append((kind, start, end))

    def finish(self) -> None:
        self._finished.set()

    def wait(self, timeout_s: float) -> bool:
        """True once finished (within `timeout_s`)."""
        return self._finished.wait(timeout_s)


@dataclass(slots=True)
class WindowSections:
    """One window's timeline, sealed when it was scheduled."""

    kinds: tuple[str, ...]
    """The name of each kind of section."""
    since: float
    """When the window's first step began: the previous window's last step end (or the log's start)."""
    steps: list[int]
    """The steps of the window, in order (at most `max_steps`)."""
    step_ends: list[float]
    """When each of them ended (`Telemetry.step()`)."""
    sections: list[Section]
    """The host-timed sections, in the order they ended."""
    complete_steps: int | None = None
    """When sections past the log's capacity were not kept, the steps that ended before the first of
    them (the later ones lost some of theirs); None when every section was kept."""
    late: list[LateSections] = field(default_factory=list)
    """Sections placed on the host timeline by another thread (CUDA phases)."""
    events: list[tuple[int, Any, Any]] = field(default_factory=list)
    """(kind, start event, end event) of completed CUDA timing events not yet placed (the sync wait)."""


class SectionLog:
    """The sections and step ends of the current window (see the module), written on the training
    thread; `seal()` hands the window over and starts the next."""

    __slots__ = (
        "_capacity",
        "_complete_steps",
        "_count",
        "_end",
        "_events",
        "_kind",
        "_late",
        "_max_steps",
        "_since",
        "_start",
        "_step",
        "_step_end",
        "_steps",
        "kinds",
    )

    def __init__(
        self,
        kinds: Sequence[str] = (),
        *,
        capacity: int = DEFAULT_SECTIONS,
        max_steps: int = DEFAULT_MAX_STEPS,
        since: float | None = None,
    ) -> None:
        """`since`: when the first window's first step began (default: now)."""
        self.kinds = tuple(kinds)
        self._capacity = capacity
        self._kind = [0] * capacity
        self._start = [0.0] * capacity
        self._end = [0.0] * capacity
        self._count = 0
        self._max_steps = max_steps if capacity else 0
        self._step = [0] * self._max_steps
        self._step_end = [0.0] * self._max_steps
        self._steps = 0
        self._since = time.perf_counter() if since is None else since
        self._complete_steps: int | None = None
        self._late: list[LateSections] = []
        self._events: list[tuple[int, Any, Any]] = []

    @property
    def keeps(self) -> bool:
        """Whether anything is kept (traces are on)."""
        return self._capacity > 0

    def kind(self, name: str) -> int:
        """The index of the last kind named `name` (the run's own sections come after the phases, so a
        phase named like one, "checkpoint", keeps its own kind)."""
        return len(self.kinds) - 1 - self.kinds[::-1].index(name)

    def record(self, kind: int, start: float, end: float) -> None:
        """A section of `kind` ran from `start` to `end` (host `perf_counter` seconds)."""
        count = self._count
        if count < self._capacity:
            self._kind[count] = kind
            self._start[count] = start
            self._end[count] = end
            self._count = count + 1
        elif self._capacity and self._complete_steps is None:
            self._complete_steps = self._steps

    def stepped(self, step: int, at: float) -> None:
        """Step `step` ended at `at`."""
        steps = self._steps
        if steps < self._max_steps:
            self._step[steps] = step
            self._step_end[steps] = at
            self._steps = steps + 1

    def late(self) -> LateSections | None:
        """Sections of this window that another thread will place (None when nothing is kept)."""
        if not self._capacity:
            return None
        late = LateSections()
        self._late.append(late)
        return late

    def record_events(self, kind: int, start: Any, end: Any) -> None:
        """A section of `kind` timed by two completed CUDA timing events, placed later off this thread."""
        if len(self._events) + self._count < self._capacity:
            self._events.append((kind, start, end))

    def seal(self) -> WindowSections | None:
        """The current window's timeline (None when nothing is kept); the next window starts empty,
        but for sections that ended after this window's last step: they belong to the next one's first
        (a wait for a collection inside the `step()` that scheduled this window, a checkpoint)."""
        if not self._capacity:
            return None
        steps, count = self._steps, self._count
        last = self._step_end[steps - 1] if steps else float("inf")
        sections = list(zip(self._kind[:count], self._start[:count], self._end[:count], strict=True))
        later = (
            [section for section in sections if section[2] > last]
            if count and max(self._end[:count]) > last
            else []
        )
        if later:
            sections = [section for section in sections if section[2] <= last]
        sealed = WindowSections(
            self.kinds,
            self._since,
            self._step[:steps],
            self._step_end[:steps],
            sections,
            complete_steps=self._complete_steps,
            late=self._late,
            events=self._events,
        )
        self._count = self._steps = 0
        self._complete_steps = None
        self._late, self._events = [], []
        if steps:
            self._since = last
        for section in later:
            self.record(*section)
        return sealed


class HostAnchor:
    """Places completed timing events of one device on the host's `perf_counter` timeline: `event` is
    recorded now on `stream` (an idle one, so it completes at once; None: the current stream) and
    waited for, and the host time it completed at is noted. Off the training thread only: it waits."""

    __slots__ = ("event", "host_time")

    def __init__(self, event: Any, stream: Any = None) -> None:
        before = time.perf_counter()
        if stream is None:
            event.record()
        else:
            event.record(stream)
        event.synchronize()
        self.host_time = (before + time.perf_counter()) / 2
        self.event = event

    def place(self, event: Any) -> float:
        """The host time at which `event` (completed, recorded before the anchor) was reached."""
        return self.host_time - event.elapsed_time(self.event) / 1000


NO_SECTIONS = SectionLog(capacity=0)
"""A log that keeps nothing: the timers' default."""
