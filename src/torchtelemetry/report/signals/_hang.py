"""Hangs: where each rank is (`Heartbeat`, written by the training thread) and which rank a hang is
waiting for (`find_hang`, on the exporting rank), under the names `train/hang/*`.

The training thread writes its `Heartbeat` with plain assignments (the step it is in, whether it
waits for a collection): no lock, no collective, no clock; the phases it is inside are read from
their timers. A thread per rank publishes it about
once a second; the exporting rank reads every rank's (`RankBeat`) and, once any rank made no
progress for `hang_after_s`, exports the rank furthest behind (by step, then phase order, then how
long it has been stuck), its step and phase, how long, and how many ranks stopped publishing
altogether (`lost`). None of it grows with the world size: ranks travel as values.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue

__all__ = [
    "BETWEEN_PHASES",
    "COLLECT_PHASE",
    "HANG_DESCRIPTORS",
    "Hang",
    "Heartbeat",
    "RankBeat",
    "find_hang",
    "hang_values",
]

BETWEEN_PHASES = "none"
"""The phase label of a rank inside no phase (between `step()` and its first phase)."""
COLLECT_PHASE = "collect"
"""The phase label of a training thread waiting for a window's collection."""

HANG_DESCRIPTORS = (
    MetricDescriptor(
        "train/hang/seconds",
        MetricKind.GAUGE,
        "seconds",
        "Seconds since the rank furthest behind last made progress (0: no hang)",
    ),
    MetricDescriptor("train/hang/rank", MetricKind.GAUGE, "", "Rank furthest behind in the last hang"),
    MetricDescriptor("train/hang/step", MetricKind.GAUGE, "", "Step the rank furthest behind stopped in"),
    MetricDescriptor(
        "train/hang/phase",
        MetricKind.GAUGE,
        "",
        "1 for the phase the rank furthest behind stopped in (no series: no hang)",
        "phase",
    ),
    MetricDescriptor(
        "train/hang/lost_ranks", MetricKind.GAUGE, "", "Ranks whose heartbeat stopped altogether"
    ),
    MetricDescriptor(
        "train/hang/dump",
        MetricKind.GAUGE,
        "",
        "The stack file the rank furthest behind wrote, as label; the value is that rank",
        "file",
    ),
)
"""Every name a hang report carries; exported by the exporting rank's monitor, not by windows."""


class SectionTimer(Protocol):
    """A timed section of the training thread (a phase, the data wait), as the heartbeat reads it."""

    name: str

    def state(self) -> tuple[int, float]:
        """(How deep the thread is inside the section, the host time it last entered it)."""
        ...


class Heartbeat:
    """Where the training thread is, read by another thread (which tolerates a torn read: it only
    compares and copies).

    The training thread writes `step` (the step being trained: one past the last
    `Telemetry.step()`) and, around a blocking wait for a window's collection, `collecting` and
    `collections`, with plain assignments. Phases and the data wait record nothing for it: `where()`
    reads their timers' own state (`timers`), so entering and leaving a phase costs the same with the
    heartbeat as without (bench/README.md).
    """

    __slots__ = ("collecting", "collections", "step", "timers")

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.collecting = False
        """The training thread waits for a window's collection (the phase "collect")."""
        self.collections = 0
        """Waits for a collection begun: each is progress."""
        self.timers: tuple[SectionTimer, ...] = ()
        """The phases and the data wait the training thread may be inside."""

    def where(self) -> tuple[int, str, Hashable]:
        """(step, innermost phase, progress) as read now, from another thread. The innermost phase
        is the one entered last among those the thread is inside; `progress` changes with every
        entry and exit of a phase (a phase entered again, as micro-batches do, is progress)."""
        states = tuple(timer.state() for timer in self.timers)
        progress = (self.collections, states)
        if self.collecting:
            return self.step, COLLECT_PHASE, progress
        inside = [(at, timer.name) for timer, (depth, at) in zip(self.timers, states, strict=True) if depth]
        return self.step, max(inside)[1] if inside else BETWEEN_PHASES, progress


@dataclass(frozen=True, slots=True)
class RankBeat:
    """One rank's heartbeat as the exporting rank sees it."""

    rank: int
    step: int
    phase: str
    stalled_s: float
    """Seconds since the rank last made progress."""
    lost: bool = False
    """The rank stopped publishing (its process died or froze whole)."""
    dump: str = ""
    """The stack file the rank wrote for this hang (empty before it did)."""


@dataclass(frozen=True, slots=True)
class Hang:
    """A hang: the rank furthest behind and the ranks lost."""

    behind: RankBeat
    lost_ranks: int


def find_hang(beats: Sequence[RankBeat], phases: Sequence[str], hang_after_s: float) -> Hang | None:
    """The hang among `beats`, or None while every rank made progress within `hang_after_s`.

    Furthest behind, among the lost ranks if any (a rank that died is what the others wait for,
    wherever they stopped): the lowest step, then the earliest phase (not in a phase, the data wait,
    then `phases` in their declared order, then anything else such as the window collection), then
    the longest stalled.
    """
    if not beats or all(beat.stalled_s < hang_after_s for beat in beats):
        return None
    order = {BETWEEN_PHASES: -2, "data": -1, **{name: index for index, name in enumerate(phases)}}
    candidates = [beat for beat in beats if beat.lost] or beats
    behind = min(
        candidates, key=lambda beat: (beat.step, order.get(beat.phase, len(phases)), -beat.stalled_s)
    )
    return Hang(behind, sum(beat.lost for beat in beats))


def hang_values(hang: Hang | None, lost_ranks: int = 0) -> dict[str, ReportValue]:
    """A hang report: the hang's values, or (None) the values that clear the last one (seconds 0, no
    phase, no file; rank and step keep naming the last hang)."""
    if hang is None:
        return {
            "train/hang/seconds": 0.0,
            "train/hang/phase": {},
            "train/hang/dump": {},
            "train/hang/lost_ranks": float(lost_ranks),
        }
    behind = hang.behind
    return {
        "train/hang/seconds": behind.stalled_s,
        "train/hang/rank": float(behind.rank),
        "train/hang/step": float(behind.step),
        "train/hang/phase": {behind.phase: 1.0},
        "train/hang/dump": {behind.dump: float(behind.rank)} if behind.dump else {},
        "train/hang/lost_ranks": float(hang.lost_ranks),
    }
