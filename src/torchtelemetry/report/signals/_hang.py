"""Hangs: where each rank is (`Heartbeat`, written by the training thread) and which rank a hang is
waiting for (`find_hang`, on the exporting rank), under the names `train/hang/*`.

The training thread writes its `Heartbeat` with plain assignments (the step it is in, the phases it
is inside, a count of moves): no lock, no collective, no clock. A thread per rank publishes it about
once a second; the exporting rank reads every rank's (`RankBeat`) and, once any rank made no
progress for `hang_after_s`, exports the rank furthest behind (by step, then phase order, then how
long it has been stuck), its step and phase, how long, and how many ranks stopped publishing
altogether (`lost`). None of it grows with the world size: ranks travel as values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


class Heartbeat:
    """Where the training thread is, written by it alone with plain assignments (read by another
    thread, which tolerates a torn read: it only compares and copies).

    `step`: the step being trained (one past the last `Telemetry.step()`); `phases`: the phases the
    thread is inside, innermost last; `moves`: a count of phase entries, so that re-entering the same
    phase (micro-batches) counts as progress.
    """

    __slots__ = ("moves", "phases", "step")

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.phases: list[str] = []
        self.moves = 0

    def where(self) -> tuple[int, str, int]:
        """(step, innermost phase, moves) as read now, from another thread."""
        innermost = self.phases[-1:]
        return self.step, innermost[0] if innermost else BETWEEN_PHASES, self.moves


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
