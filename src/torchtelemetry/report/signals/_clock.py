"""Clocks for phases: the host's monotonic clock on CPU, CUDA events read off the training thread.

A clock times sections of one rank and hands back, once per window, batches of
`(seconds per phase, steps covered)`. The host clock's batch is the window itself. The event
clock records two events on the current stream per section (no sync); a reader thread waits for
each batch's events to complete and reads their elapsed times, so a window carries the batches
read by the time it was scheduled, usually those of the window before (`take(wait=True)` waits for
all of them: at a checkpoint and at close).

With traces on, each section's times also go to the window's `SectionLog`: the traced host clock
(and timer) hand over the two times they take anyway, the event clock's reader the events' times
placed on the host timeline by a `HostAnchor` (traces off: the plain clock and timer, and a log
that keeps nothing).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from torchtelemetry.report.signals._timeline import NO_SECTIONS, HostAnchor, LateSections, SectionLog

__all__ = [
    "EventClock",
    "HostClock",
    "HostPhaseTimer",
    "HostTimer",
    "PhaseClock",
    "PhaseTimer",
    "TracedHostClock",
    "TracedHostTimer",
]

logger = logging.getLogger(__name__)

_get_ident = threading.get_ident
_perf_counter = time.perf_counter

Batch = tuple[list[float], int]
"""Seconds per phase and the steps they cover."""


class PhaseClock(Protocol):
    """Times sections of one rank; `take` hands back what was timed, once per window."""

    def start(self) -> Any: ...

    def stop(self, index: int, started: Any) -> None: ...

    def entered_at(self, started: Any) -> float:
        """The host time (`perf_counter`) at which the section `started` (from `start`) began."""
        ...

    def take(self, steps: int, *, wait: bool = False, timeout_s: float = 60.0) -> list[Batch]: ...

    def close(self) -> None: ...


class PhaseTimer:
    """`with telemetry.phase("forward"):` adds the block's time to its phase. Other phases may nest
    in it; the same phase entered again inside itself is part of the outer block (counted once).
    Entered only on the thread that built it (the training thread). The heartbeat reads where the
    thread is from `state()` (another thread): entering and leaving record nothing more for it."""

    __slots__ = ("_clock", "_depth", "_index", "_started", "_thread", "name")

    def __init__(self, clock: PhaseClock, index: int, name: str) -> None:
        self._clock = clock
        self._index = index
        self._started: Any = None
        self._depth = 0
        self._thread = TrainingThread(f"Telemetry.phase({name!r})")
        self.name = name

    def __enter__(self) -> PhaseTimer:
        if _get_ident() != self._thread.ident:
            self._thread.check()
        if not self._depth:
            self._started = self._clock.start()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._clock.stop(self._index, self._started)

    def state(self) -> tuple[int, float]:
        """(How deep the thread is inside this phase, when it last entered it), read from any thread."""
        started = self._started
        return self._depth, (self._clock.entered_at(started) if started is not None else 0.0)


class HostPhaseTimer(PhaseTimer):
    """A `PhaseTimer` of a `HostClock`: adds each block's seconds to the clock's `seconds` itself
    (what the clock's `stop` does, without the call: a phase costs its two `with` calls)."""

    __slots__ = ("_seconds",)

    def __init__(self, clock: HostClock, index: int, name: str) -> None:
        super().__init__(clock, index, name)
        self._seconds = clock.seconds

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._seconds[self._index] += _perf_counter() - self._started


class HostTimer:
    """`with timer:` hands the block's host seconds to `record` (reusable; a block entered again
    inside itself is counted once; the data wait). Entered only on the thread that built it; the
    heartbeat reads `state()`, as a `PhaseTimer`'s."""

    __slots__ = ("_depth", "_record", "_started", "_thread", "name")

    def __init__(
        self, record: Callable[[float], None], name: str = "data", op: str = "Telemetry.data_wait()"
    ) -> None:
        self._record = record
        self._started = 0.0
        self._depth = 0
        self._thread = TrainingThread(op)
        self.name = name

    def __enter__(self) -> HostTimer:
        if _get_ident() != self._thread.ident:
            self._thread.check()
        if not self._depth:
            self._started = _perf_counter()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._record(_perf_counter() - self._started)

    def state(self) -> tuple[int, float]:
        """(How deep the thread is inside this block, when it last entered it), read from any thread."""
        return self._depth, self._started


class TracedHostTimer(HostTimer):
    """A `HostTimer` that also hands each block's two times to the window's timeline `log` as a
    section of `kind` (traces on; off, the timer is a plain `HostTimer` and costs nothing more)."""

    __slots__ = ("_kind", "_log")

    def __init__(
        self,
        record: Callable[[float], None],
        name: str,
        op: str = "Telemetry.data_wait()",
        *,
        log: SectionLog,
        kind: int,
    ) -> None:
        super().__init__(record, name, op)
        self._log = log
        self._kind = kind

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            ended = time.perf_counter()
            self._record(ended - self._started)
            self._log.record(self._kind, self._started, ended)


class TrainingThread:
    """The thread that built a timer: a section timed on another thread (a prefetch thread) would
    add its time to the training thread's step (a data wait of 116 % of the step), so it is refused."""

    __slots__ = ("_name", "_op", "ident")

    def __init__(self, op: str) -> None:
        self.ident = threading.get_ident()
        """The training thread's id (a timer compares it before calling `check`)."""
        self._name = threading.current_thread().name
        self._op = op

    def check(self) -> None:
        """Raise a `RuntimeError` naming the calling thread unless it is the training thread."""
        if threading.get_ident() != self.ident:
            raise RuntimeError(
                f"{self._op}: entered from thread {threading.current_thread().name!r}, but it times "
                f"the steps of thread {self._name!r} that built the Telemetry (the training thread); "
                "time sections on the training thread, e.g. the wait for a batch a prefetch thread "
                "made: `with telemetry.data_wait(): batch = queue.get()`"
            )


class HostClock:
    """`time.perf_counter()`: what the host spent in each section (CPU training)."""

    start = _perf_counter
    """`start()`: the time now (the clock itself: a section's start costs no Python call)."""

    def __init__(self, phases: int) -> None:
        self.seconds = [0.0] * phases
        """Each phase's seconds since the last `take` (zeroed in place there: timers hold it)."""

    def timer(self, index: int, name: str) -> PhaseTimer:
        """The timer of phase `name` (this clock's phase `index`): a `HostPhaseTimer`, which adds to
        `seconds` itself, unless a subclass's `stop` does more (`TracedHostClock` logs the section):
        then a `PhaseTimer`, which calls it."""
        if type(self).stop is HostClock.stop:
            return HostPhaseTimer(self, index, name)
        return PhaseTimer(self, index, name)

    def stop(self, index: int, started: float) -> None:
        self.seconds[index] += time.perf_counter() - started

    def entered_at(self, started: float) -> float:
        return started

    def take(self, steps: int, *, wait: bool = False, timeout_s: float = 60.0) -> list[Batch]:
        seconds = self.seconds[:]
        self.seconds[:] = [0.0] * len(seconds)
        return [(seconds, steps)]

    def close(self) -> None:
        """Nothing to release: a host clock holds no thread and no event."""


class TracedHostClock(HostClock):
    """A `HostClock` that also hands each section's two times to the window's timeline `log` (a
    phase's index is its kind there): traces on; off, the clock is a plain `HostClock`."""

    def __init__(self, phases: int, log: SectionLog) -> None:
        super().__init__(phases)
        self._log = log

    def stop(self, index: int, started: float) -> None:
        ended = time.perf_counter()
        self.seconds[index] += ended - started
        self._log.record(index, started, ended)


class EventClock:
    """Device time of each section: a pair of timing events on the current stream, read by a daemon
    thread (`torchtelemetry-phase-reader`) once they completed; events are pooled and reused.

    `make_event` builds an event with `record()`, `synchronize()` and `elapsed_time(end)` in
    milliseconds (default: a CUDA timing event whose `synchronize()` yields the CPU). When `log` keeps
    sections, the reader places each batch's events on the host timeline (`HostAnchor`) and hands
    them to the window they were timed in.
    """

    def __init__(
        self,
        phases: int,
        device: torch.device,
        make_event: Callable[[], Any] | None = None,
        log: SectionLog = NO_SECTIONS,
    ) -> None:
        self._phases = phases
        self._device = device
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True, blocking=True))
        self._log = log
        self._pool: collections.deque[Any] = collections.deque()
        self._sections: list[tuple[int, Any, Any]] = []
        self._batches: collections.deque[
            tuple[list[tuple[int, Any, Any]], int, LateSections | None] | None
        ] = collections.deque()
        self._read: list[Batch] = []
        self._unread = 0
        self._changed = threading.Condition()
        self._reader: threading.Thread | None = None
        self._failed = False

    def _event(self) -> Any:
        try:
            return self._pool.pop()
        except IndexError:
            return self._make_event()

    def start(self) -> tuple[float, Any]:
        event = self._event()
        event.record()
        return time.perf_counter(), event

    def stop(self, index: int, started: tuple[float, Any]) -> None:
        event = self._event()
        event.record()
        self._sections.append((index, started[1], event))

    def entered_at(self, started: tuple[float, Any]) -> float:
        return started[0]

    def take(self, steps: int, *, wait: bool = False, timeout_s: float = 60.0) -> list[Batch]:
        """Hand the sections since the last call to the reader; return the batches it has read
        (all of them with `wait`, up to `timeout_s`)."""
        sections, self._sections = self._sections, []
        with self._changed:
            if sections or steps:
                self._start_reader()
                self._batches.append((sections, steps, self._log.late() if sections else None))
                self._unread += 1
                self._changed.notify_all()
            if wait and not self._changed.wait_for(lambda: self._unread == 0, timeout_s):
                logger.warning(
                    "Telemetry: phase events not completed after %.0f s; their times come with a "
                    "later window",
                    timeout_s,
                )
            read, self._read = self._read, []
        return read

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._run, name="torchtelemetry-phase-reader", daemon=True)
            self._reader.start()

    def _run(self) -> None:
        stream = None
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            stream = torch.cuda.Stream(self._device)  # idle: an anchor recorded there completes at once
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._batches))
                batch = self._batches.popleft()
            if batch is None:
                return
            sections, steps, late = batch
            seconds = [0.0] * self._phases
            try:
                for index, started, ended in sections:
                    ended.synchronize()
                    seconds[index] += started.elapsed_time(ended) / 1000
                if late is not None:
                    anchor = HostAnchor(self._event(), stream)
                    for index, started, ended in sections:
                        late.add(index, anchor.place(started), anchor.place(ended))
                    self._pool.append(anchor.event)
            except RuntimeError as error:  # a failed device: the training thread hears of it
                if not self._failed:
                    self._failed = True
                    logger.warning("Telemetry: phase events could not be read: %s", error)
            for _, started, ended in sections:
                self._pool.extend((started, ended))
            if late is not None:
                late.finish()
            with self._changed:
                self._read.append((seconds, steps))
                self._unread -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Stop the reader once it has read what it was given (bounded)."""
        if self._reader is None:
            return
        with self._changed:
            self._batches.append(None)
            self._changed.notify_all()
        self._reader.join(timeout=60.0)
