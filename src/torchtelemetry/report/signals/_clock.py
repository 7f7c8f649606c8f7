"""Clocks for phases and the timers that use them: the host's monotonic clock on CPU (here), CUDA
events read off the training thread (`_event_clock.EventClock`).

A clock times sections of one rank and hands back, once per window, batches of
`(seconds per phase, steps covered)`. The host clock's batch is the window itself.

With traces on, each section's times also go to the window's `SectionLog`: the traced host clock
(and timer) hand over the two times they take anyway, the event clock's reader the events' times
placed on the host timeline by a `HostAnchor` (traces off: the plain clock and timer, and a log
that keeps nothing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from torchtelemetry.report.signals._timeline import SectionLog

__all__ = [
    "Batch",
    "HostClock",
    "HostPhaseTimer",
    "HostTimer",
    "PhaseClock",
    "PhaseTimer",
    "TracedHostClock",
    "TracedHostTimer",
]

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
