"""Straggler scores from phase times: against the median rank, against the rank's own best, the
sync wait taken out of the phase that holds the all-reduce, thresholds from the run's own noise."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from torchtelemetry.report.signals import MIN_COST, MIN_EXCESS, MIN_NOISE_WINDOWS, StragglerScores


def test_the_slowest_rank_per_phase_is_a_value_scored_against_the_median() -> None:
    scores = StragglerScores(top_k=2)
    times = {
        "forward": {0: 0.10, 1: 0.10, 2: 0.165, 3: 0.10},
        "backward": {0: 0.20, 1: 0.26, 2: 0.14, 3: 0.20},
    }
    report = scores.score(times, {"forward": 30.0, "backward": 50.0})
    assert report["train/straggler/rank"] == {"forward": 2.0, "backward": 1.0}
    assert report["train/straggler/score"]["forward"] == pytest.approx(1.65)
    assert report["train/straggler/score"]["backward"] == pytest.approx(1.3)
    # First window: every rank is its own best; the run's noise is not known yet, so nobody is
    # named a straggler.
    assert report["train/straggler/own_best_score"] == {"forward": 1.0, "backward": 1.0}
    assert "train/straggler/threshold" not in report and "train/straggler/top_rank" not in report


def test_the_wait_in_the_all_reduce_is_taken_out_of_the_phase_that_holds_it() -> None:
    """Rank 2 is slow in its forward; the others wait for it in backward's all-reduce, rank 0
    longest (it arrived first). Less the wait, every rank's backward is the same work."""
    times = {
        "forward": {0: 0.10, 1: 0.16, 2: 0.22, 3: 0.16},
        "backward": {0: 0.26, 1: 0.20, 2: 0.14, 3: 0.20},
    }
    sync_wait = {0: 0.12, 1: 0.06, 2: 0.0, 3: 0.06}
    unwatched = StragglerScores(top_k=1).score(times, {"forward": 30.0, "backward": 50.0})
    assert unwatched["train/straggler/rank"]["backward"] == 0.0  # the rank that waits longest
    scores = StragglerScores(top_k=1)
    scores.sync_phase = "backward"
    report = scores.score(times, {"forward": 30.0, "backward": 50.0}, sync_wait)
    assert report["train/straggler/score"]["backward"] == pytest.approx(1.0)
    assert report["train/straggler/rank"]["forward"] == 2.0


def _window(scores: StragglerScores, forward: dict[int, float], share: float = 40.0) -> dict:
    return scores.score({"forward": forward}, {"forward": share})


def test_a_steady_straggler_is_named_once_the_noise_is_known_and_it_passed_two_windows() -> None:
    scores = StragglerScores(top_k=3)
    wobble = [1.0, 1.04, 0.97, 1.02, 0.99, 1.03, 0.98, 1.01]
    reports = [_window(scores, {0: 0.1 * w, 1: 0.1 / w, 2: 0.16, 3: 0.1}) for w in wobble]
    for report in reports[: MIN_NOISE_WINDOWS - 1]:
        assert "train/straggler/threshold" not in report
    for report in reports[MIN_NOISE_WINDOWS - 1 :]:
        assert report["train/straggler/threshold"]["forward"] == pytest.approx(1 + MIN_EXCESS)
    assert "train/straggler/top_rank" not in reports[MIN_NOISE_WINDOWS - 1]  # passed once so far
    for report in reports[MIN_NOISE_WINDOWS:]:
        assert report["train/straggler/top_rank"] == {"1": 2.0}
        assert report["train/straggler/top_score"]["1"] == pytest.approx(1.6, rel=0.05)


def test_a_noisy_host_raises_the_threshold_above_its_own_spikes() -> None:
    """Two healthy ranks on a shared host: whichever the neighbour slowed takes 1.6-1.7 times the
    other's time in a window (a score above 1.2), the other one in the next; the threshold rises
    with that spread."""
    scores = StragglerScores(top_k=3)
    slowed = [(1.0, 1.7), (1.6, 1.0), (1.0, 1.65), (1.7, 1.0), (1.0, 1.6), (1.65, 1.0), (1.0, 1.7)] * 2
    reports = [_window(scores, {0: 0.1 * a, 1: 0.1 * b}) for a, b in slowed]
    for report in reports[MIN_NOISE_WINDOWS - 1 :]:
        threshold = report["train/straggler/threshold"]["forward"]
        assert report["train/straggler/score"]["forward"] < threshold
        assert "train/straggler/top_rank" not in report
    # Against the fixed 1.2 of before, every window would have named a straggler.
    assert all(report["train/straggler/score"]["forward"] > 1.2 for report in reports[1:])


def test_the_threshold_is_the_mean_change_factor_of_the_ranks_near_the_median_cubed() -> None:
    scores = StragglerScores(top_k=1)
    # Rank 2 barely enters the phase and rank 3 straggles: neither says how the others spread.
    windows = [{0: 1.0, 1: 1.0, 2: 0.01, 3: 9.0}, {0: 1.1, 1: 1.0, 2: 0.03, 3: 8.0}]
    windows += [{0: 1.0, 1: 1.1, 2: 0.01, 3: 9.5}, {0: 1.1, 1: 1.0, 2: 0.02, 3: 8.5}]
    for forward in windows:
        report = _window(scores, forward)
    medians = [sorted(window.values())[1:3] for window in windows]
    score_ = [
        {rank: t / (sum(m) / 2) for rank, t in w.items()} for w, m in zip(windows, medians, strict=True)
    ]
    changes = [
        abs(math.log(now[rank] / before[rank]))
        for before, now in itertools.pairwise(score_)
        for rank in (0, 1)
    ]
    expected = math.exp(3 * sum(changes) / len(changes))
    assert report["train/straggler/threshold"]["forward"] == pytest.approx(max(expected, 1 + MIN_EXCESS))


def test_a_rank_slower_than_its_own_best_is_named_even_when_all_slow_down_together() -> None:
    scores = StragglerScores(top_k=3)
    scores.score({"forward": {0: 0.1, 1: 0.1}}, {"forward": 50.0})
    report = scores.score({"forward": {0: 0.1, 1: 0.25}}, {"forward": 50.0})
    assert report["train/straggler/own_best_rank"] == {"forward": 1.0}
    assert report["train/straggler/own_best_score"] == {"forward": pytest.approx(2.5)}
    # Both ranks throttled alike: no peer stands out, the own-best score still does.
    report = scores.score({"forward": {0: 0.3, 1: 0.3}}, {"forward": 50.0})
    assert report["train/straggler/score"] == {"forward": 1.0}
    assert report["train/straggler/own_best_score"] == {"forward": pytest.approx(3.0)}
    assert report["train/straggler/own_best_rank"] == {"forward": 0.0}  # lowest rank on ties


def test_a_straggler_that_costs_the_others_little_is_scored_but_not_named() -> None:
    scores = StragglerScores(top_k=2)
    for _ in range(MIN_NOISE_WINDOWS + 2):
        report = scores.score({"tiny": {0: 1e-5, 1: 5e-5, 2: 1e-5}}, {"tiny": MIN_COST / 10})
    assert report["train/straggler/rank"]["tiny"] == 1.0 and report["train/straggler/score"]["tiny"] == 5.0
    # (5 - 1) x 0.5 % of the step: the others wait 2 % of the step for rank 1.
    assert report["train/straggler/cost"]["tiny"] == pytest.approx(0.4 * MIN_COST)
    assert "train/straggler/top_rank" not in report


def test_the_cost_of_the_phase_that_holds_the_all_reduce_counts_its_work_only() -> None:
    scores = StragglerScores(top_k=1)
    scores.sync_phase = "backward"
    times = {"backward": {0: 0.30, 1: 0.30, 2: 0.10}}  # ranks 0 and 1 wait 0.2 s for rank 2
    report = scores.score(times, {"backward": 60.0}, {0: 0.2, 1: 0.2, 2: 0.0})
    assert report["train/straggler/score"]["backward"] == pytest.approx(1.0)
    assert report["train/straggler/cost"]["backward"] == pytest.approx(0.0)


def test_phases_no_rank_spent_time_in_are_not_scored() -> None:
    report = StragglerScores(top_k=3).score({"forward": {0: 0.0, 1: 0.0}}, {})
    assert report == {}


def test_own_best_times_survive_a_checkpoint_as_json() -> None:
    scores = StragglerScores(top_k=1)
    scores.score({"forward": {0: 0.1, 1: 0.2}}, {"forward": 10.0})
    restored = StragglerScores(top_k=1)
    restored.load_state_dict(json.loads(json.dumps(scores.state_dict())))
    report = restored.score({"forward": {0: 0.3, 1: 0.2}}, {"forward": 10.0})
    assert report["train/straggler/own_best_rank"] == {"forward": 0.0}
    assert report["train/straggler/own_best_score"] == {"forward": pytest.approx(3.0)}
