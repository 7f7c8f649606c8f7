"""The rank's side of hang detection: where its training thread is, published every interval.

The training thread writes a `Heartbeat` with plain assignments, all through one writer (the
façade's window bookkeeping): the step it is in, its waits for a window's collection, and that it
left the loop (`close()` began). Phases and the data wait write nothing for it: `where()` reads
their timers' own state. A `HeartbeatPublisher` thread (`torchtelemetry-heartbeat`) reads it every
`interval_s`, notes when it last changed (progress), and sets it, authenticated, in the heartbeat
store; a failed write is retried at the next interval. A rank that made no progress for
`hang_after_s` writes its stacks once per hang (`DumpFiles`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from torchtelemetry.report import BETWEEN_PHASES, CLOSED_PHASE, COLLECT_PHASE
from torchtelemetry.run._dumps import DumpFiles
from torchtelemetry.run._hangs import RankBeat, Reading
from torchtelemetry.run._store import StoreLink, StoreUnavailable, encode_heartbeat
from torchtelemetry.run._ticker import Ticker

__all__ = ["Heartbeat", "HeartbeatPublisher", "SectionTimer"]

logger = logging.getLogger(__name__)


class SectionTimer(Protocol):
    """A timed section of the training thread (a phase, the data wait), as the heartbeat reads it."""

    name: str

    def state(self) -> tuple[int, float]:
        """(How deep the thread is inside the section, the host time it last entered it)."""
        ...


class Heartbeat:
    """Where the training thread is, read by another thread (which tolerates a torn read: it only
    compares and copies).

    Its one writer (the façade's window bookkeeping, on the training thread) sets `step` (one past
    the last `Telemetry.step()`), `collecting` and `collections` around a blocking wait for a
    window's collection, and `closed` once `close()` began. `where()` reads the phases and the data
    wait from their timers (`timers`), so entering a phase costs the same with the heartbeat as
    without (bench/README.md).
    """

    __slots__ = ("closed", "collecting", "collections", "step", "timers")

    def __init__(self, timers: Sequence[SectionTimer] = (), step: int = 0) -> None:
        self.step = step
        self.collecting = False
        """The training thread waits for a window's collection (the phase "collect")."""
        self.collections = 0
        """Waits for a collection begun: each is progress."""
        self.closed = False
        """The training thread left the loop: its `close()` began (the phase "closed")."""
        self.timers = tuple(timers)
        """The phases and the data wait the training thread may be inside."""

    def where(self) -> tuple[int, str, Hashable]:
        """(step, innermost phase, progress) as read now, from another thread. The innermost phase
        is the one entered last among those the thread is inside; `progress` changes with every
        entry and exit of a phase (a phase entered again, as micro-batches do, is progress)."""
        states = tuple(timer.state() for timer in self.timers)
        progress = (self.closed, self.collections, states)
        if self.closed:
            return self.step, CLOSED_PHASE, progress
        if self.collecting:
            return self.step, COLLECT_PHASE, progress
        inside = [(at, timer.name) for timer, (depth, at) in zip(self.timers, states, strict=True) if depth]
        return self.step, max(inside)[1] if inside else BETWEEN_PHASES, progress


class HeartbeatPublisher:
    """Publishes `beat` under `key` through `link` every `interval_s`, authenticated with `secret`,
    and writes the rank's stacks once per hang when it made no progress for `hang_after_s`.
    `run_id` names the stack files (the id the ranks agreed on: `adopt_run`)."""

    def __init__(
        self,
        beat: Heartbeat,
        link: StoreLink,
        *,
        key: str,
        secret: bytes,
        rank: int,
        run_id: str,
        hang_after_s: float,
        interval_s: float,
        dumps: DumpFiles,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.beat = beat
        self._link = link
        self.key = key
        """This rank's key in the heartbeat store."""
        self._secret = secret
        self.rank = rank
        self.run_id = run_id
        self._hang_after_s = hang_after_s
        self._clock = clock
        self._dumps = dumps
        self._where = beat.where()
        self._since = clock()
        self._count = 0
        self._failures = 0
        self.dump = ""
        """The stack file of the current hang (empty while the rank makes progress)."""
        self.published: tuple[int, str, Hashable] | None = None
        """The `Heartbeat.where()` last set in the store."""
        self._ticker = Ticker(
            self.publish, name="torchtelemetry-heartbeat", interval_s=interval_s, what="the heartbeat"
        )

    def start(self) -> HeartbeatPublisher:
        self.publish()
        self._ticker.start()
        return self

    def state(self) -> RankBeat:
        """Where this rank is and how long it made no progress, as of now."""
        step, phase, _ = self._where
        return RankBeat(self.rank, step, phase, self._clock() - self._since, dump=self.dump)

    def publish(self, *, last: bool = False) -> None:
        """Note progress, write the stacks if the rank is stuck, and set the heartbeat in the store
        (a failure is logged once, and the next interval tries again; the `last` one, at close,
        meets a store whose host may have closed first)."""
        where, now = self.beat.where(), self._clock()
        if where != self._where:
            self._where, self._since, self.dump = where, now, ""
        step, phase, _ = where
        stalled_s = now - self._since
        if stalled_s >= self._hang_after_s and not self.dump:
            self._write_stacks(step, phase, stalled_s)
        self._count += 1
        reading = Reading(self._count, step, phase, stalled_s, self.dump)
        try:
            self._link.call("set", self.key, encode_heartbeat(self._secret, self.key, reading))
        except StoreUnavailable as error:
            self._failures += 1
            if last:
                logger.info(
                    "Telemetry: rank %d's last heartbeat did not reach the store: %s", self.rank, error
                )
            elif self._failures == 1:
                logger.warning(
                    "Telemetry: rank %d could not publish its heartbeat (%s); it tries again every "
                    "interval (a rank is called lost only once its heartbeat is stale)",
                    self.rank,
                    error,
                )
            return
        if self._failures:
            logger.info("Telemetry: rank %d publishes its heartbeat again", self.rank)
            self._failures = 0
        self.published = where

    def _write_stacks(self, step: int, phase: str, stalled_s: float) -> None:
        header = (
            f"torchtelemetry: run {self.run_id} rank {self.rank} made no progress for {stalled_s:.0f} s, "
            f"at step {step} in phase {phase!r}; Python stacks of every thread (most recent call first):"
        )
        try:
            self.dump = self._dumps.write(self.run_id, step, header)
        except OSError as error:
            self.dump = f"(not written: {error})"
        logger.error(
            "Telemetry: rank %d made no progress for %.0f s (step %d, phase %r); stacks: %s",
            self.rank,
            stalled_s,
            step,
            phase,
            self.dump,
        )

    def close(self, timeout_s: float) -> None:
        """Stop publishing, after one last heartbeat (the rank closed: never a lost rank)."""
        self._ticker.close(timeout_s)
        self.publish(last=True)
