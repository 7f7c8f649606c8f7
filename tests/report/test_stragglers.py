"""Straggler scores from phase times: against the median rank, against the rank's own best, top k."""

from __future__ import annotations

import json

import pytest

from torchtelemetry.report.signals import MIN_SHARE, StragglerScores


def test_the_slowest_rank_per_phase_and_the_top_k_over_phases_are_values() -> None:
    scores = StragglerScores(top_k=2)
    times = {
        "forward": {0: 0.10, 1: 0.10, 2: 0.165, 3: 0.10},
        "backward": {0: 0.20, 1: 0.26, 2: 0.14, 3: 0.20},  # rank 2 waits less: it arrives last
    }
    report = scores.score(times, {"forward": 30.0, "backward": 50.0})
    assert report["train/straggler/rank"] == {"forward": 2.0, "backward": 1.0}
    assert report["train/straggler/score"]["forward"] == pytest.approx(1.65)
    assert report["train/straggler/score"]["backward"] == pytest.approx(1.3)
    assert report["train/straggler/top_rank"] == {"1": 2.0, "2": 1.0}
    assert report["train/straggler/top_score"] == {"1": pytest.approx(1.65), "2": pytest.approx(1.3)}
    # First window: every rank is its own best.
    assert report["train/straggler/own_best_score"] == {"forward": 1.0, "backward": 1.0}


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


def test_short_phases_are_scored_but_do_not_rank_ranks_and_ties_go_to_the_lowest_rank() -> None:
    scores = StragglerScores(top_k=2)
    times = {"tiny": {0: 1e-5, 1: 5e-5, 2: 1e-5}, "forward": {0: 0.1, 1: 0.1, 2: 0.1}}
    report = scores.score(times, {"tiny": MIN_SHARE / 2, "forward": 40.0})
    assert report["train/straggler/rank"]["tiny"] == 1.0 and report["train/straggler/score"]["tiny"] == 5.0
    assert report["train/straggler/top_rank"] == {"1": 0.0, "2": 1.0}
    assert report["train/straggler/top_score"] == {"1": 1.0, "2": 1.0}


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
