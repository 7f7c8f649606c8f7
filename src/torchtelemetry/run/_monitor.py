"""The watching side of hang detection: the exporting rank's monitor, and the deputy that watches
the exporting rank.

`HangMonitor` (thread `torchtelemetry-hang-monitor`, on the exporting rank) reads every heartbeat
each interval, one `multi_get` per 1,024 ranks, and judges them (`BeatLedger`, `find_hang`). While
a hang lasts it reports it every interval, whatever its own training thread does (blocked in a
collective, most likely); once every rank moves again, one report clears it; and the ranks that
never joined and the values refused are reported when their counts change. A value that fails its
authenticator, does not parse or is older than the last one read is refused for its rank alone.

`Deputy` (thread `torchtelemetry-hang-deputy`, on the next rank) watches the exporting rank's
heartbeat alone: when it went stale (or the store stopped answering) or the exporting rank closed,
while this rank itself made no progress for `hang_after_s`, it reports the exporting rank through
a route of its own (`report`), since the monitor stopped with it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from torchtelemetry.report import UNKNOWN_PHASE, ReportValues
from torchtelemetry.run._dumps import DumpFiles
from torchtelemetry.run._hangs import BeatLedger, Hang, RankBeat, Reading, find_hang, hang_values
from torchtelemetry.run._heartbeat import HeartbeatPublisher
from torchtelemetry.run._store import (
    KEYS_PER_READ,
    BadValue,
    StoreLink,
    StoreUnavailable,
    decode_heartbeat,
)
from torchtelemetry.run._ticker import Ticker

__all__ = ["Deputy", "HangMonitor", "Judging"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Judging:
    """How a watcher reads heartbeats and judges them."""

    secret: bytes
    """The ranks' shared key: a value whose authenticator does not match it is refused."""
    phases: tuple[str, ...]
    hang_after_s: float
    interval_s: float
    clock: Callable[[], float] = time.monotonic


class _Watcher(ABC):
    """Reads some ranks' heartbeats (`keys`: rank -> store key) into a ledger every interval, on a
    thread named `thread_name`, and reports (`report`) what `check` finds. A rank never heard from
    within `join_s` of the start is unwatched."""

    thread_name: ClassVar[str]

    def __init__(
        self,
        link: StoreLink,
        keys: dict[int, str],
        judging: Judging,
        *,
        join_s: float,
        report: Callable[[ReportValues], None],
    ) -> None:
        self._link = link
        self._keys = keys
        self._secret = judging.secret
        self._phases = judging.phases
        self._hang_after_s = judging.hang_after_s
        self._report = report
        self._clock = judging.clock
        self._interval_s = judging.interval_s
        self.ledger = BeatLedger(
            list(keys), started=self._clock(), hang_after_s=self._hang_after_s, join_s=join_s
        )
        self._refused: set[int] = set()
        self.hang: Hang | None = None
        """The hang the last report named (None: no hang reported, or it cleared)."""
        self.reads = 0
        """Reads of the heartbeats so far."""
        name = self.thread_name
        self._ticker = Ticker(
            self.check, name=name, interval_s=judging.interval_s, what=name.replace("-", " ")
        )
        self._reported: tuple[int, int] = (0, 0)
        self._unwatched: set[int] = set()

    def start(self) -> _Watcher:
        self._ticker.start()
        return self

    def read(self) -> None:
        """Read every watched heartbeat into the ledger; a value refused counts for its rank alone."""
        ranks = list(self._keys)
        values = []
        for first in range(0, len(ranks), KEYS_PER_READ):
            chunk = [self._keys[rank] for rank in ranks[first : first + KEYS_PER_READ]]
            values += (
                self._link.call("multi_get", chunk) if len(chunk) > 1 else [self._link.call("get", chunk[0])]
            )
        now = self._clock()
        for rank, value in zip(ranks, values, strict=True):
            try:
                reading = decode_heartbeat(self._secret, self._keys[rank], value)
            except BadValue as error:
                self.ledger.refused()
                self._log_refused(rank, str(error))
                continue
            if reading is not None and not self.ledger.heard(rank, reading, now):
                self._log_refused(rank, "older than the value read before (a replay)")
        self.reads += 1

    def _log_refused(self, rank: int, why: str) -> None:
        if rank not in self._refused:
            self._refused.add(rank)
            logger.warning(
                "Telemetry: the heartbeat of rank %d held a value refused (%s); ignored, and counted "
                "in train/hang/rejected_values (logged once per rank)",
                rank,
                why,
            )

    @abstractmethod
    def check(self) -> None:
        """Read, judge and report, once."""

    def _judge(self, hang: Hang | None, beats: list[RankBeat], unwatched: int, force: bool) -> None:
        """Report `hang` (or that it cleared) when there is one, it just cleared, or `force`."""
        cleared = hang is None and self.hang is not None
        if hang is None and not cleared and not force:
            return
        lost = sum(beat.lost for beat in beats)
        self._report(
            hang_values(hang, lost_ranks=lost, unwatched_ranks=unwatched, rejected=self.ledger.rejected)
        )
        if cleared:
            logger.warning("Telemetry: every rank makes progress again; the hang report is cleared")
        elif hang is not None and (self.hang is None or self.hang.behind.rank != hang.behind.rank):
            behind = hang.behind
            stuck = [beat.rank for beat in beats if beat.stalled_s >= self._hang_after_s and not beat.closed]
            logger.error(
                "Telemetry: hang: rank %d made no progress for %.0f s, at step %d in phase %r; stuck "
                "ranks %s, lost ranks %s, closed ranks %s; stack files so far: %s",
                behind.rank,
                behind.stalled_s,
                behind.step,
                behind.phase,
                stuck,
                [beat.rank for beat in beats if beat.lost],
                [beat.rank for beat in beats if beat.closed],
                [beat.dump for beat in beats if beat.dump] or "none yet",
            )
        self.hang = hang

    def close(self, timeout_s: float) -> None:
        """Stop watching, after one last look (so that a hang cleared just before is reported cleared)."""
        self._ticker.close(timeout_s)
        try:
            self.check()
        except StoreUnavailable as error:
            logger.warning("Telemetry: %s could not look at the heartbeats a last time: %s", self, error)


class HangMonitor(_Watcher):
    """The exporting rank's monitor of every rank's heartbeat; `report` exports a hang report."""

    thread_name = "torchtelemetry-hang-monitor"

    def check(self) -> None:
        """Read every heartbeat; report a hang while one lasts, once when it clears, and the ranks
        unwatched and values refused whenever their counts change."""
        self.read()
        now = self._clock()
        beats = self.ledger.beats(now)
        unwatched = self.ledger.unwatched(now)
        for rank in sorted(set(unwatched) - self._unwatched):
            logger.warning(
                "Telemetry: rank %d never published its heartbeat; hangs there are not detected "
                "(its own log says why), counted in train/hang/unwatched_ranks",
                rank,
            )
        self._unwatched.update(unwatched)
        named = self.hang.behind.rank if self.hang is not None else None
        hang = find_hang(beats, self._phases, self._hang_after_s, self._interval_s, named)
        counts = (len(unwatched), self.ledger.rejected)
        self._judge(hang, beats, len(unwatched), force=counts != self._reported)
        self._reported = counts

    def __str__(self) -> str:
        return "the hang monitor"


class Deputy(_Watcher):
    """On the rank after the exporting rank `leader`: reports `leader` when it stopped (stale or
    closed) while this rank (`publisher`'s) made no progress for `hang_after_s`, with this rank's
    stacks as evidence (`dumps`): they show where it waits for the leader."""

    thread_name = "torchtelemetry-hang-deputy"

    def __init__(
        self,
        link: StoreLink,
        leader: int,
        key: str,
        judging: Judging,
        *,
        publisher: HeartbeatPublisher,
        dumps: DumpFiles,
        report: Callable[[ReportValues], None],
    ) -> None:
        super().__init__(link, {leader: key}, judging, join_s=0.0, report=report)
        self._leader = leader
        self._publisher = publisher
        self._dumps = dumps
        self._evidence = ""
        self._unanswered_since: float | None = None
        self._told_unanswered = False
        # Seen at the start, nowhere yet: a leader (and its store) that freezes before the first
        # read goes stale all the same.
        self.ledger.heard(leader, Reading(0, 0, UNKNOWN_PHASE, 0.0), self._clock())

    def check(self) -> None:
        """Read the leader's heartbeat (a store that does not answer is no news: the heartbeat
        goes stale) and report the leader when it stopped while this rank waits."""
        now = self._clock()
        try:
            self.read()
            self._unanswered_since = None
        except StoreUnavailable as error:
            since = self._unanswered_since = self._unanswered_since or now
            if now - since >= self._hang_after_s and not self._told_unanswered:
                self._told_unanswered = True
                logger.warning(
                    "Telemetry: rank %d has not read the exporting rank's heartbeat for %.0f s (%s)",
                    self._publisher.rank,
                    now - since,
                    error,
                )
        beats = self.ledger.beats(self._clock())
        own = self._publisher.state()
        hang = None
        if beats and (beats[0].lost or beats[0].closed) and own.stalled_s >= self._hang_after_s:
            hang = find_hang(
                [beats[0], own], self._phases, self._hang_after_s, self._interval_s, self._leader
            )
            if hang is not None and hang.behind.rank == self._leader:
                hang = dataclasses.replace(
                    hang, behind=dataclasses.replace(hang.behind, dump=self._evident(hang, own))
                )
            else:
                hang = None
        if hang is None:
            self._evidence = ""
        self._judge(hang, beats, 0, force=False)

    def _evident(self, hang: Hang, own: RankBeat) -> str:
        """This rank's stack file for the hang of the leader (written once per hang)."""
        if not self._evidence:
            leader = hang.behind
            run_id = self._publisher.run_id
            header = (
                f"torchtelemetry: run {run_id}: rank {own.rank} reports the exporting rank {leader.rank} "
                f"({'closed' if leader.closed else 'no heartbeat'} for {leader.stalled_s:.0f} s, at step "
                f"{leader.step} in phase {leader.phase!r}) while this rank made no progress for "
                f"{own.stalled_s:.0f} s at step {own.step} in phase {own.phase!r}; this rank's Python "
                "stacks (most recent call first):"
            )
            try:
                self._evidence = self._dumps.write(run_id, leader.step, header, about=leader.rank)
            except OSError as error:
                self._evidence = f"(not written: {error})"
        return self._evidence

    def __str__(self) -> str:
        return "the hang deputy"
