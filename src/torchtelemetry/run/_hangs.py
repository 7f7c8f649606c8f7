"""Which rank a hang waits for: a pure judgement of the heartbeats read and the reader's clock.

The exporting rank's monitor (and, when the exporting rank itself stops, the next rank) feeds a
`BeatLedger` what it reads from each rank's heartbeat and when (`heard`), and asks it for every
rank's state at a time (`beats`); `find_hang` names the rank the others wait for. Nothing here
reads a clock or a store, so tests give both as data and get exact verdicts.

The ordering rule (docs/signals.md, Hangs): a hang exists once a rank that did not close made no
progress for `hang_after_s`, or its heartbeat did not change for that long (lost). A heartbeat that
did not change for two intervals is stale: its rank (frozen, or dead) is placed at the lowest step
a live rank stands still in (no progress for two intervals: it waits there), when that is past its
last heartbeat, in phase `unknown` (it did not reach the collective they wait in). The rank named
is, among the lost ranks if any, else among all ranks, the one at the earliest point of the loop:
the lowest step, then the earliest place in it (unknown, closed, not in a phase, the data wait, the
declared phases in order, then the window's collection). Among ranks at the same point the one named
before stays named, else the one stuck longest, then the lowest rank: the name is stable for the
whole hang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torchtelemetry.report import (
    BETWEEN_PHASES,
    CLOSED_PHASE,
    DATA_PHASE,
    UNKNOWN_PHASE,
    ReportValue,
)

__all__ = [
    "HANG_DUMP",
    "HANG_RANK",
    "HANG_STEP",
    "STALE_INTERVALS",
    "BeatLedger",
    "Hang",
    "RankBeat",
    "Reading",
    "find_hang",
    "hang_values",
]


HANG_RANK = "train/hang/rank"
HANG_STEP = "train/hang/step"
HANG_DUMP = "train/hang/dump"

STALE_INTERVALS = 2
"""A heartbeat unchanged for this many intervals is stale (its rank did not publish), and a rank
without progress for as long stands still."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One heartbeat as a rank published it."""

    count: int
    """How many heartbeats the rank published before this one, plus one: grows with each."""
    step: int
    """The step its training thread is in (one past its last `step()`)."""
    phase: str
    """The innermost phase it is inside, or a heartbeat label (`HEARTBEAT_LABELS`)."""
    stalled_s: float
    """Seconds since it last made progress, when it published."""
    dump: str = ""
    """Its stack file for the current hang (empty before it wrote one)."""


@dataclass(frozen=True, slots=True)
class RankBeat:
    """One rank's state as the reader judges it."""

    rank: int
    step: int
    phase: str
    stalled_s: float
    """Seconds since the rank last made progress."""
    silent_s: float = 0.0
    """Seconds since its heartbeat last changed (as read)."""
    lost: bool = False
    """Its heartbeat did not change for `hang_after_s` (its process died or froze whole)."""
    dump: str = ""
    """The stack file the rank wrote for this hang (empty before it did)."""

    @property
    def closed(self) -> bool:
        """The rank left the loop (its `close()` began)."""
        return self.phase == CLOSED_PHASE


@dataclass(frozen=True, slots=True)
class Hang:
    """A hang: the rank the others wait for and how many ranks are lost."""

    behind: RankBeat
    lost_ranks: int


class BeatLedger:
    """What a reader knows of `ranks`' heartbeats: the last reading accepted from each and when it
    changed, on the reader's clock (`now`, seconds). Readings are accepted in publishing order only:
    one older than the last accepted is a replay, refused and counted."""

    def __init__(self, ranks: Sequence[int], *, started: float, hang_after_s: float, join_s: float) -> None:
        self._hang_after_s = hang_after_s
        self._started = started
        self._join_s = join_s
        self._readings: dict[int, Reading | None] = dict.fromkeys(ranks)
        self._heard: dict[int, float] = dict.fromkeys(ranks, started)
        self.rejected = 0
        """Values refused so far (`refused`, replays)."""

    def heard(self, rank: int, reading: Reading, now: float) -> bool:
        """Take `rank`'s `reading`, read at `now`; False (and counted) when it is older than the one
        accepted last (a replay)."""
        last = self._readings[rank]
        if last is not None and reading.count <= last.count:
            if reading == last:
                return True
            self.rejected += 1
            return False
        self._readings[rank], self._heard[rank] = reading, now
        return True

    def refused(self) -> None:
        """Count a value that failed its authenticator or could not be read."""
        self.rejected += 1

    def unwatched(self, now: float) -> list[int]:
        """Ranks never heard from though `join_s` passed since the start: they did not join."""
        if now - self._started < self._join_s:
            return []
        return [rank for rank, reading in self._readings.items() if reading is None]

    def beats(self, now: float) -> list[RankBeat]:
        """Every rank heard from, as of `now`."""
        beats = []
        for rank, reading in self._readings.items():
            if reading is None:
                continue
            silent_s = now - self._heard[rank]
            lost = silent_s >= self._hang_after_s and reading.phase != CLOSED_PHASE
            stalled_s = reading.stalled_s + silent_s
            beats.append(RankBeat(rank, reading.step, reading.phase, stalled_s, silent_s, lost, reading.dump))
        return beats


def find_hang(
    beats: Sequence[RankBeat],
    phases: Sequence[str],
    hang_after_s: float,
    interval_s: float,
    named: int | None = None,
) -> Hang | None:
    """The hang among `beats`, heartbeats published every `interval_s`, or None while every rank
    that did not close moves (see the module). `named` is the rank the hang named so far: it stays
    named while no rank is at an earlier point."""
    stuck = [beat for beat in beats if beat.lost or (beat.stalled_s >= hang_after_s and not beat.closed)]
    if not stuck:
        return None
    still_s = STALE_INTERVALS * interval_s
    standing = [
        beat.step
        for beat in beats
        if beat.silent_s < still_s and beat.stalled_s >= still_s and not beat.closed
    ]
    waited_at = min(standing, default=None)
    placed = [
        _placed(beat, waited_at) if beat.silent_s >= still_s and not beat.closed else beat for beat in beats
    ]
    order = {
        UNKNOWN_PHASE: -4,
        CLOSED_PHASE: -3,
        BETWEEN_PHASES: -2,
        DATA_PHASE: -1,
        **{name: index for index, name in enumerate(phases)},
    }

    def point(beat: RankBeat) -> tuple[int, int]:
        return beat.step, order.get(beat.phase, len(phases))

    lost = [beat for beat in placed if beat.lost]
    candidates = lost or placed
    earliest = min(point(beat) for beat in candidates)
    tied = [beat for beat in candidates if point(beat) == earliest]
    behind = next((beat for beat in tied if beat.rank == named), None)
    if behind is None:
        behind = min(tied, key=lambda beat: (-beat.stalled_s, beat.rank))
    return Hang(behind, len(lost))


def _placed(beat: RankBeat, waited_at: int | None) -> RankBeat:
    """A rank whose heartbeat is stale, at the step live ranks stand still in when that is past its
    last heartbeat: it did not reach the collective they wait in; where in that step it stopped is
    unknown."""
    if waited_at is None or waited_at <= beat.step:
        return beat
    return dataclasses.replace(beat, step=waited_at, phase=UNKNOWN_PHASE, dump="")


def hang_values(
    hang: Hang | None, *, lost_ranks: int = 0, unwatched_ranks: int = 0, rejected: int = 0
) -> dict[str, ReportValue]:
    """A hang report: the hang's values, or (None) the values that clear the last one (seconds 0, no
    phase, no file; rank and step keep naming the last hang); with the ranks unwatched and the
    heartbeat values refused so far."""
    counts: dict[str, ReportValue] = {
        "train/hang/unwatched_ranks": float(unwatched_ranks),
        "train/hang/rejected_values": float(rejected),
    }
    if hang is None:
        return {
            "train/hang/seconds": 0.0,
            "train/hang/phase": {},
            HANG_DUMP: {},
            "train/hang/lost_ranks": float(lost_ranks),
            **counts,
        }
    behind = hang.behind
    return {
        "train/hang/seconds": behind.stalled_s,
        HANG_RANK: float(behind.rank),
        HANG_STEP: float(behind.step),
        "train/hang/phase": {behind.phase: 1.0},
        HANG_DUMP: {behind.dump: float(behind.rank)} if behind.dump else {},
        "train/hang/lost_ranks": float(hang.lost_ranks),
        **counts,
    }
