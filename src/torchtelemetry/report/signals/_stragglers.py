"""Straggler scores from phase times: what synchronous training hides in its step time.

When ranks wait for each other every step, every rank's step time is the slowest rank's, so a
straggler shows only inside the sections it is slow in. The wait itself lands in the phase that
holds the synchronization (`sync_phase`, "backward" by default: DDP's all-reduce inside
`loss.backward()`): there the ranks that wait take longest, and the rank they wait for takes least.
So that only the rank that causes the wait is ever named, that phase is scored on its time less
the wait each rank measured there (`train/sync_wait`, `Telemetry.watch_gradient_sync`); where some
rank's wait is not measured and several ranks are timed, the phase is left out of the scores (no
value names a rank there) and a warning says so once, naming the fix. Per phase and rank, two
scores, as nvidia-resiliency-ext's straggler detection scores its sections:

- `score` = the rank's time / the median of the OTHER ranks' times in this window: how much slower
  than its peers (on 2 ranks, the ratio of the two: a rank 150 times slower scores 150);
- `own_best_score` = the rank's time / its own best window so far: how much slower than itself
  (a rank that slows down, e.g. throttling, while its peers slow down with it).

A score is a straggler's only above the phase's `threshold`, derived from the run's own
window-to-window spread: the factor by which a rank's score changes from one window to the next,
on (geometric) mean over the last `NOISE_WINDOWS` windows and the ranks whose score is within a
factor `BULK` of 1, to the power `NOISE_SPREADS`, at least 1 + `MIN_EXCESS` and at least the
score of a rank `MIN_EXCESS_S` per step slower than the others' median. A noisy host moves every
rank's score from window to window and raises the threshold; a straggler's score stays put,
however far above 1 it is. Known from `MIN_NOISE_WINDOWS` windows on.

Reported per phase: the worst rank, its score, the threshold and the cost (the percent of the
step the other ranks wait for it there: its time less the others' median, over the window's
seconds per step), as values. Over phases, the stragglers: up to `top_k` ranks whose score passed
its phase's threshold in this window and the one before (a noisy host's one-window spike names
nobody) at a cost of at least `MIN_COST` percent of the step (a rank 3 times slower in a phase of
0.5 % of the step costs nobody anything), place 1 the slowest.

`StragglerScores.score` is a pure function of the times it is given (and the windows before):
tests feed it timelines and assert exact verdicts.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import highest_rank

__all__ = [
    "BULK",
    "DEFAULT_SYNC_PHASE",
    "MIN_EXCESS",
    "MIN_NOISE_WINDOWS",
    "MIN_COST",
    "NOISE_SPREADS",
    "NOISE_WINDOWS",
    "StragglerScores",
    "medians_of_others",
    "phase_work",
]

logger = logging.getLogger(__name__)

DEFAULT_SYNC_PHASE = "backward"
"""The phase that holds the gradient collective unless `watch_gradient_sync(phase=)` names another."""
MIN_COST = 5.0
"""Percent of the step the other ranks must wait for a rank in a phase for it to be named."""
MIN_EXCESS = 0.2
"""The lowest threshold is 1 + this: a rank 20 % slower than the others' median in a phase."""
MIN_EXCESS_S = 0.002
"""Nor is the threshold below the score of a rank 2 ms per step slower than the others' median: under
that, a busy host's scheduling moves the ranks' times by as much (a healthy 2-rank run beside a CPU
hog scored a rank 1.7 two windows running in a phase of 1 ms of work per step)."""
NOISE_SPREADS = 3.0
"""The threshold is the mean window-to-window change factor of a rank's score to this power."""
NOISE_WINDOWS = 16
"""Windows the window-to-window changes are taken over."""
BULK = 2.0
"""The noise is taken over the ranks whose score is within this factor of 1: not the straggler
itself, nor a rank that barely enters the phase, whose scores move by large factors that say
nothing of the others' spread. Where no rank is, two windows running (2 ranks, one of them a
straggler), the noise is unknown and the threshold is its floor."""
MIN_NOISE_WINDOWS = 4
"""Windows of a phase before its threshold is known (and its ranks can be named in the top k)."""

SCORE = "train/straggler/score"
RANK = "train/straggler/rank"
OWN_BEST_SCORE = "train/straggler/own_best_score"
OWN_BEST_RANK = "train/straggler/own_best_rank"
THRESHOLD = "train/straggler/threshold"
COST = "train/straggler/cost"
TOP_RANK = "train/straggler/top_rank"
TOP_SCORE = "train/straggler/top_score"


class StragglerScores:
    """Scores one window's phase times per rank; keeps each rank's best time per phase (checkpointed)
    and each phase's recent scores (not checkpointed: a restarted run learns its noise again)."""

    def __init__(self, top_k: int, *, sync_phase: str = DEFAULT_SYNC_PHASE, warn: bool = True) -> None:
        self.top_k = top_k
        self.sync_phase = sync_phase
        """The phase that holds the gradient collective, scored less the sync wait (or not at all)."""
        self._warn = warn  # whether this rank logs that `sync_phase` is left out (one rank does)
        self._best: dict[str, dict[int, float]] = {}
        self._recent: dict[str, deque[dict[int, float]]] = {}
        self._passing: dict[str, set[int]] = {}
        self._named = False
        """Whether the last window named a straggler (the next one to name nobody says so)."""
        self._warned = False
        self._lock = threading.Lock()

    @staticmethod
    def descriptors() -> list[MetricDescriptor]:
        def by_phase(name: str, description: str) -> MetricDescriptor:
            return MetricDescriptor(name, MetricKind.GAUGE, "", description, "phase")

        def by_place(name: str, description: str) -> MetricDescriptor:
            return MetricDescriptor(name, MetricKind.GAUGE, "", description, "place")

        return [
            by_phase(SCORE, "Slowest rank's phase time over the other ranks' median, per phase"),
            by_phase(RANK, "Rank with the highest straggler score, per phase"),
            by_phase(OWN_BEST_SCORE, "Highest phase time of a rank over its own best window, per phase"),
            by_phase(OWN_BEST_RANK, "Rank with the highest own-best score, per phase"),
            by_phase(THRESHOLD, "Score above which a rank straggles, from the run's window-to-window spread"),
            MetricDescriptor(
                COST,
                MetricKind.GAUGE,
                "percent",
                "Percent of the step the other ranks wait for the slowest rank in the phase",
                "phase",
            ),
            by_place(TOP_RANK, "The ranks that straggle over phases (place 1 is the slowest), as rank ids"),
            by_place(TOP_SCORE, "Straggler score of each of the slowest ranks (place 1 is the slowest)"),
        ]

    def score(
        self,
        times: Mapping[str, Mapping[int, float]],
        step_s: float,
        sync_wait: Mapping[int, float] | None = None,
    ) -> dict[str, ReportValue]:
        """The scores of one window: `times[phase][rank]` seconds per step, `step_s` the window's
        seconds per step (0: unknown, so no cost and nobody named), `sync_wait[rank]` seconds per
        step waited for the gradient collective (inside `sync_phase`). `top_rank` and `top_score`
        are absent while nobody straggles, and empty in the first window after a straggler: a
        scrape endpoint, which serves a name's last value until a report replaces it, drops them."""
        names = (SCORE, RANK, OWN_BEST_SCORE, OWN_BEST_RANK, THRESHOLD, COST)
        out: dict[str, dict[str, float]] = {name: {} for name in names}
        overall: dict[int, float] = {}
        with self._lock:
            for phase, raw in times.items():
                timed = self._work(phase, {rank: s for rank, s in raw.items() if s > 0}, sync_wait or {})
                if timed:
                    for rank, score in self._score_phase(phase, timed, step_s, out).items():
                        overall[rank] = max(overall.get(rank, 0.0), score)
        top = sorted(overall.items(), key=lambda item: (-item[1], item[0]))[: self.top_k]
        report: dict[str, ReportValue] = {name: values for name, values in out.items() if values}
        if top:
            report[TOP_RANK] = {str(place): float(rank) for place, (rank, _) in enumerate(top, start=1)}
            report[TOP_SCORE] = {str(place): score for place, (_, score) in enumerate(top, start=1)}
        elif self._named:  # nobody any more: empty once, so that no backend keeps the last ones
            report[TOP_RANK], report[TOP_SCORE] = {}, {}
        self._named = bool(top)
        return report

    def _work(self, phase: str, timed: dict[int, float], sync_wait: Mapping[int, float]) -> dict[int, float]:
        """`timed` of `phase` as the ranks' own work (`phase_work`); empty, said once, where the sync
        wait is not known."""
        work = phase_work(phase, timed, sync_wait, self.sync_phase)
        if work is None:
            unmeasured = sorted(timed.keys() - sync_wait.keys())
            if self._warn and not self._warned:
                self._warned = True
                logger.warning(
                    "Telemetry: no rank is named a straggler in phase %r: it holds the gradient "
                    "collective, where the ranks that wait take longest, and the wait is not measured "
                    "(%d of %d ranks, rank %d first); call telemetry.watch_gradient_sync(model) on "
                    "every rank (docs/signals.md)",
                    phase,
                    len(unmeasured),
                    len(timed),
                    unmeasured[0],
                )
            return {}
        return work

    def _score_phase(
        self, phase: str, timed: dict[int, float], step_s: float, out: dict[str, dict[str, float]]
    ) -> dict[int, float]:
        """Write `phase`'s values into `out`; the ranks passing its threshold this window and the one
        before, with their scores."""
        best = self._best.setdefault(phase, {})
        for rank, seconds in timed.items():
            best[rank] = min(best.get(rank, seconds), seconds)
        own = {rank: seconds / best[rank] for rank, seconds in timed.items()}
        worst_own = highest_rank(own)
        out[OWN_BEST_SCORE][phase], out[OWN_BEST_RANK][phase] = own[worst_own], float(worst_own)
        if len(timed) < 2:  # no peer to compare with
            return {}
        others = medians_of_others(timed)
        scores = {rank: seconds / others[rank] for rank, seconds in timed.items()}
        costs = {
            rank: 100 * (seconds - others[rank]) / step_s if step_s > 0 else 0.0
            for rank, seconds in timed.items()
        }
        worst = highest_rank(scores)
        out[SCORE][phase], out[RANK][phase], out[COST][phase] = scores[worst], float(worst), costs[worst]
        bulk = {rank: score for rank, score in scores.items() if 1 / BULK <= score <= BULK}
        threshold = self._threshold(phase, bulk, others[worst])
        if threshold is None:
            return {}
        out[THRESHOLD][phase] = threshold
        passing = {
            rank: score for rank, score in scores.items() if score > threshold and costs[rank] >= MIN_COST
        }
        before, self._passing[phase] = self._passing.get(phase, set()), set(passing)
        return {rank: passing[rank] for rank in passing.keys() & before}

    def _threshold(self, phase: str, bulk: dict[int, float], baseline: float) -> float | None:
        """Remember this window's scores of `phase`'s bulk ranks; its threshold once
        `MIN_NOISE_WINDOWS` are known (`baseline`: the others' median seconds per step of its
        slowest rank)."""
        recent = self._recent.setdefault(phase, deque(maxlen=NOISE_WINDOWS))
        recent.append(bulk)
        changes = [
            abs(math.log(now[rank] / before[rank]))
            for before, now in itertools.pairwise(recent)
            for rank in now.keys() & before.keys()
        ]
        if len(recent) < MIN_NOISE_WINDOWS:
            return None
        noise = math.exp(NOISE_SPREADS * statistics.fmean(changes)) if changes else 1.0
        return max(1.0 + MIN_EXCESS, 1.0 + MIN_EXCESS_S / baseline, noise)

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


def phase_work(
    phase: str, timed: Mapping[int, float], sync_wait: Mapping[int, float], sync_phase: str
) -> dict[int, float] | None:
    """`timed[rank]`, seconds per step in `phase`, as the ranks' own work: in `sync_phase` (with
    several ranks) less each rank's sync wait, ranks left with none dropped; None there when some
    rank's wait is not known (the ranks that wait would score slowest)."""
    if phase != sync_phase or len(timed) < 2:
        return dict(timed)
    if timed.keys() - sync_wait.keys():
        return None
    work = {rank: seconds - sync_wait[rank] for rank, seconds in timed.items()}
    return {rank: seconds for rank, seconds in work.items() if seconds > 0}


def medians_of_others(times: Mapping[int, float]) -> dict[int, float]:
    """For each rank, the median of the other ranks' times (at least two ranks; O(n log n))."""
    ordered = sorted(times.items(), key=lambda item: item[1])
    values = [seconds for _, seconds in ordered]
    size = len(values) - 1  # the others of each rank

    def other(position: int, index: int) -> float:  # the index-th smallest time without `position`'s
        return values[index] if index < position else values[index + 1]

    return {
        rank: (other(position, (size - 1) // 2) + other(position, size // 2)) / 2
        for position, (rank, _) in enumerate(ordered)
    }
