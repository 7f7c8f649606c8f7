"""Straggler scores from phase times: what synchronous training hides in its step time.

When ranks wait for each other every step, every rank's step time is the slowest rank's, so a
straggler shows only inside the sections it is slow in (a fast rank waits in its backward's
all-reduce, the slow one does not). Per phase and rank, two scores, as nvidia-resiliency-ext's
straggler detection scores its sections:

- `score` = the rank's time / the median rank's time in this window: how much slower than its peers;
- `own_best_score` = the rank's time / its own best window so far: how much slower than itself
  (a rank that slows down, e.g. throttling, while its peers slow down with it).

Reported per phase: the worst rank and its score, as values. Over phases: the `top_k` ranks by
their worst `score` in any phase taking at least `MIN_SHARE` percent of the step (shorter phases
are too short to rank a whole rank on), place 1 being the slowest.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import highest_rank, median

__all__ = ["MIN_SHARE", "StragglerScores"]

MIN_SHARE = 1.0
"""Percent of the step a phase must take for its scores to rank ranks in the top k."""

SCORE = "train/straggler/score"
RANK = "train/straggler/rank"
OWN_BEST_SCORE = "train/straggler/own_best_score"
OWN_BEST_RANK = "train/straggler/own_best_rank"
TOP_RANK = "train/straggler/top_rank"
TOP_SCORE = "train/straggler/top_score"


class StragglerScores:
    """Scores one window's phase times per rank; keeps each rank's best time per phase (checkpointed)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._best: dict[str, dict[int, float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def descriptors() -> list[MetricDescriptor]:
        def by_phase(name: str, description: str) -> MetricDescriptor:
            return MetricDescriptor(name, MetricKind.GAUGE, "", description, "phase")

        def by_place(name: str, description: str) -> MetricDescriptor:
            return MetricDescriptor(name, MetricKind.GAUGE, "", description, "place")

        return [
            by_phase(SCORE, "Slowest rank's phase time over the median rank's, per phase"),
            by_phase(RANK, "Rank with the highest straggler score, per phase"),
            by_phase(OWN_BEST_SCORE, "Highest phase time of a rank over its own best window, per phase"),
            by_phase(OWN_BEST_RANK, "Rank with the highest own-best score, per phase"),
            by_place(TOP_RANK, "The slowest ranks over phases (place 1 is the slowest), as rank ids"),
            by_place(TOP_SCORE, "Straggler score of each of the slowest ranks (place 1 is the slowest)"),
        ]

    def score(
        self, times: Mapping[str, Mapping[int, float]], shares: Mapping[str, float]
    ) -> dict[str, ReportValue]:
        """The scores of one window: `times[phase][rank]` seconds per step, `shares[phase]` percent."""
        out: dict[str, dict[str, float]] = {name: {} for name in (SCORE, RANK, OWN_BEST_SCORE, OWN_BEST_RANK)}
        overall: dict[int, float] = {}
        with self._lock:
            for phase, by_rank in times.items():
                timed = {rank: seconds for rank, seconds in by_rank.items() if seconds > 0}
                if not timed:
                    continue
                best = self._best.setdefault(phase, {})
                for rank, seconds in timed.items():
                    best[rank] = min(best.get(rank, seconds), seconds)
                own = {rank: seconds / best[rank] for rank, seconds in timed.items()}
                worst_own = highest_rank(own)
                out[OWN_BEST_SCORE][phase], out[OWN_BEST_RANK][phase] = own[worst_own], float(worst_own)
                middle = median(timed)
                scores = {rank: seconds / middle for rank, seconds in timed.items()}
                worst = highest_rank(scores)
                out[SCORE][phase], out[RANK][phase] = scores[worst], float(worst)
                if shares.get(phase, 0.0) >= MIN_SHARE:
                    for rank, score in scores.items():
                        overall[rank] = max(overall.get(rank, 0.0), score)
        top = sorted(overall.items(), key=lambda item: (-item[1], item[0]))[: self.top_k]
        report: dict[str, ReportValue] = {name: values for name, values in out.items() if values}
        if top:
            report[TOP_RANK] = {str(place): float(rank) for place, (rank, _) in enumerate(top, start=1)}
            report[TOP_SCORE] = {str(place): score for place, (_, score) in enumerate(top, start=1)}
        return report

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                phase: {str(rank): best for rank, best in ranks.items()}
                for phase, ranks in self._best.items()
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            self._best = {
                phase: {int(rank): float(best) for rank, best in ranks.items()}
                for phase, ranks in state.items()
            }
