"""Straggler scores on synthetic timelines: exact verdicts, whatever machine runs them.

`StragglerScores.score` is a pure function of the per-rank phase times and sync waits it is given
(and the windows before): each test builds the times a synchronous data-parallel run would show,
with the wait where DDP puts it (every rank leaves the backward's all-reduce together), and
asserts which ranks are named in which window.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import statistics
from typing import Any

import pytest

from torchtelemetry.report.signals import (
    MIN_COST,
    MIN_EXCESS,
    MIN_NOISE_WINDOWS,
    NOISE_SPREADS,
    StragglerScores,
)
from torchtelemetry.report.signals._stragglers import MIN_EXCESS_S, medians_of_others

WORK = {"data": 0.05, "forward": 0.2, "backward": 0.3, "optimizer": 0.1}
"""Seconds per step of each phase's own work on a healthy rank."""
SLOW_S = 0.2
"""What a straggler adds to one phase: about a quarter of the step, far above `MIN_COST`."""
WORLDS = (2, 3, 4, 7, 16, 64)


def synchronous_window(
    work: dict[int, dict[str, float]], *, holding: str = "backward"
) -> tuple[dict[str, dict[int, float]], dict[int, float], float]:
    """The phase times, sync waits and seconds per step of ranks doing `work[rank][phase]`: every
    rank leaves the collective at the end of `holding` together, so each waits there for the rank
    with the most work in the step."""
    totals = {rank: sum(phases.values()) for rank, phases in work.items()}
    step_s = max(totals.values())
    waits = {rank: step_s - total for rank, total in totals.items()}
    times = {
        phase: {rank: work[rank][phase] + (waits[rank] if phase == holding else 0.0) for rank in work}
        for phase in WORK
    }
    return times, waits, step_s


def healthy_work(world: int, rng: random.Random, jitter: float = 0.01) -> dict[int, dict[str, float]]:
    """Each rank's work per phase, moved by up to +-`jitter` (a quiet host's noise)."""
    return {
        rank: {phase: seconds * (1 + rng.uniform(-jitter, jitter)) for phase, seconds in WORK.items()}
        for rank in range(world)
    }


def named(report: dict[str, Any]) -> list[int]:
    """The ranks `top_rank` names, place 1 first."""
    places = report.get("train/straggler/top_rank", {})
    return [int(places[place]) for place in sorted(places, key=int)]


def run(
    scores: StragglerScores,
    windows: list[dict[int, dict[str, float]]],
    *,
    waits_measured: bool = True,
) -> list[dict[str, Any]]:
    """Score a timeline of windows of per-rank work."""
    reports = []
    for work in windows:
        times, waits, step_s = synchronous_window(work)
        reports.append(scores.score(times, step_s, waits if waits_measured else None))
    return reports


# -- the scores ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 64])
def test_the_median_of_the_others_is_the_median_without_the_rank(world: int) -> None:
    rng = random.Random(world)
    for _ in range(50):
        times = {rank: float(rng.choice([1, 2, 2, 3, 5, 8])) * rng.choice([1, 1.5]) for rank in range(world)}
        expected = {
            rank: statistics.median(t for other, t in times.items() if other != rank) for rank in times
        }
        assert medians_of_others(times) == expected


def test_on_two_ranks_a_rank_150_times_slower_scores_150() -> None:
    """The median of two is their mean, which capped the old score below 2 (1.97 for a forward
    150 times slower); against the other rank, the magnitude reads true."""
    report = StragglerScores(top_k=1).score({"forward": {0: 0.001, 1: 0.15}}, 1.0)
    assert report["train/straggler/rank"] == {"forward": 1.0}
    assert report["train/straggler/score"]["forward"] == pytest.approx(150.0)
    # The others wait 149 ms of a 1 s step for it.
    assert report["train/straggler/cost"]["forward"] == pytest.approx(14.9)


def test_the_slowest_rank_per_phase_is_scored_against_the_others_median() -> None:
    times = {
        "forward": {0: 0.10, 1: 0.10, 2: 0.165, 3: 0.12},
        "optimizer": {0: 0.20, 1: 0.26, 2: 0.14, 3: 0.20},
    }
    report = StragglerScores(top_k=2).score(times, 0.5)
    assert report["train/straggler/rank"] == {"forward": 2.0, "optimizer": 1.0}
    assert report["train/straggler/score"]["forward"] == pytest.approx(0.165 / 0.10)
    assert report["train/straggler/score"]["optimizer"] == pytest.approx(0.26 / 0.20)
    assert report["train/straggler/cost"]["forward"] == pytest.approx(100 * 0.065 / 0.5)
    # First window: every rank is its own best, and the run's noise is not known yet.
    assert report["train/straggler/own_best_score"] == {"forward": 1.0, "optimizer": 1.0}
    assert "train/straggler/threshold" not in report and not named(report)


def test_a_world_of_one_is_scored_against_its_own_best_only() -> None:
    scores = StragglerScores(top_k=1)
    scores.score({"forward": {0: 0.1}, "backward": {0: 0.2}}, 1.0)  # no wait measured: nobody waits
    report = scores.score({"forward": {0: 0.3}, "backward": {0: 0.2}}, 1.0)
    assert report == {
        "train/straggler/own_best_score": {"forward": pytest.approx(3.0), "backward": 1.0},
        "train/straggler/own_best_rank": {"forward": 0.0, "backward": 0.0},
    }


def test_the_wait_in_the_collective_is_taken_out_of_the_phase_that_holds_it() -> None:
    """Rank 2 is slow in its forward; the others wait for it in backward's all-reduce. Less the
    wait, every rank's backward is the same work, and the cost counts that work only."""
    times = {
        "forward": {0: 0.10, 1: 0.16, 2: 0.22, 3: 0.16},
        "backward": {0: 0.26, 1: 0.20, 2: 0.14, 3: 0.20},
    }
    report = StragglerScores(top_k=1).score(times, 0.5, {0: 0.12, 1: 0.06, 2: 0.0, 3: 0.06})
    assert report["train/straggler/score"]["backward"] == pytest.approx(1.0)
    assert report["train/straggler/cost"]["backward"] == pytest.approx(0.0)
    assert report["train/straggler/rank"]["forward"] == 2.0


def test_unmeasured_the_phase_holding_the_collective_names_nobody_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1 is slow in its forward and nothing measures the wait: rank 0's backward is the
    longest (it waits), so no value of the backward is reported; the forward names rank 1."""
    times, _, step_s = synchronous_window({0: dict(WORK), 1: {**WORK, "forward": 0.4}})
    assert times["backward"][0] > times["backward"][1]
    scores = StragglerScores(top_k=2)
    with caplog.at_level(logging.WARNING):
        reports = [scores.score(times, step_s) for _ in range(MIN_NOISE_WINDOWS + 2)]
    for report in reports:
        for name in ("score", "rank", "own_best_score", "own_best_rank", "threshold", "cost"):
            assert "backward" not in report.get(f"train/straggler/{name}", {}), name
        assert report["train/straggler/rank"]["forward"] == 1.0
    assert named(reports[-1]) == [1]
    (warning,) = [record.getMessage() for record in caplog.records]
    assert "phase 'backward'" in warning and "watch_gradient_sync(model)" in warning
    # A wait known for only some ranks is not measured either.
    assert "backward" not in StragglerScores(top_k=1).score(times, step_s, {0: 0.2})["train/straggler/rank"]
    # The exporting rank warns; the others keep quiet.
    caplog.clear()
    StragglerScores(top_k=1, warn=False).score(times, step_s)
    assert not caplog.records


def test_another_phase_can_be_the_one_that_holds_the_collective() -> None:
    scores = StragglerScores(top_k=1, sync_phase="optimizer")  # watch_gradient_sync(phase="optimizer")
    report = scores.score({"backward": {0: 0.3, 1: 0.1}, "optimizer": {0: 0.3, 1: 0.1}}, 1.0)
    assert report["train/straggler/rank"] == {"backward": 0.0}


# -- thresholds and verdicts over a run --------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("phase", list(WORK))
def test_a_slow_rank_is_named_in_the_phase_it_is_slow_in_and_nobody_else_ever(world: int, phase: str) -> None:
    """From the window its phase's threshold is known in and the one before, for the rest of the
    run; before that, nobody."""
    rng = random.Random(f"{world}-{phase}")
    slow = world // 2
    windows = []
    for _ in range(12):
        work = healthy_work(world, rng)
        work[slow][phase] += SLOW_S
        windows.append(work)
    reports = run(StragglerScores(top_k=3), windows)
    for index, report in enumerate(reports):
        assert report["train/straggler/rank"][phase] == slow
        assert named(report) == ([slow] if index >= MIN_NOISE_WINDOWS else []), index


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_slow_in_its_forward_never_gets_a_waiting_rank_named_without_the_wait(world: int) -> None:
    rng = random.Random(world)
    windows = []
    for _ in range(12):
        work = healthy_work(world, rng)
        work[world - 1]["forward"] += SLOW_S
        windows.append(work)
    reports = run(StragglerScores(top_k=3, warn=False), windows, waits_measured=False)
    assert all(
        named(report) == ([world - 1] if i >= MIN_NOISE_WINDOWS else []) for i, report in enumerate(reports)
    )
    # A rank slow in the backward itself cannot be told from the ranks that wait for it there.
    windows = [healthy_work(world, rng) for _ in range(12)]
    for work in windows:
        work[0]["backward"] += SLOW_S
    assert not any(
        named(report) for report in run(StragglerScores(top_k=3, warn=False), windows, waits_measured=False)
    )


@pytest.mark.parametrize("world", WORLDS)
def test_noise_that_moves_every_rank_names_nobody_and_hides_no_straggler(world: int) -> None:
    """A host that slows every rank alike (0.5x to 3x from window to window) moves no score."""
    rng = random.Random(world)
    factors = [1.0, 3.0, 0.5, 2.0, 1.5, 0.7, 2.5, 1.0, 0.6, 3.0, 1.2, 2.0]

    def moved(work: dict[int, dict[str, float]], factor: float) -> dict[int, dict[str, float]]:
        return {rank: {p: s * factor for p, s in phases.items()} for rank, phases in work.items()}

    healthy = [moved(healthy_work(world, rng), factor) for factor in factors]
    assert not any(named(report) for report in run(StragglerScores(top_k=3), healthy))
    straggling = []
    for factor in factors:
        work = healthy_work(world, rng)
        work[0]["forward"] *= 1.6
        straggling.append(moved(work, factor))
    reports = run(StragglerScores(top_k=3), straggling)
    assert [named(report) for report in reports] == [[]] * MIN_NOISE_WINDOWS + [[0]] * (
        len(factors) - MIN_NOISE_WINDOWS
    )


@pytest.mark.parametrize("world", WORLDS)
def test_a_hog_that_slows_one_rank_for_one_window_is_not_named(world: int) -> None:
    """Each rank in turn is slowed 3x in every phase for one window: it passes the threshold in
    that window only, and a rank is named only two windows running. Slowed two windows running,
    it is named in the second (the rule's limit)."""
    rng = random.Random(world)
    windows = [healthy_work(world, rng) for _ in range(MIN_NOISE_WINDOWS + 2 * min(world, 8))]
    for index in range(MIN_NOISE_WINDOWS, len(windows), 2):
        hogged = (index - MIN_NOISE_WINDOWS) // 2 % world
        windows[index][hogged] = {phase: 3 * seconds for phase, seconds in WORK.items()}
    reports = run(StragglerScores(top_k=3), windows)
    assert not any(named(report) for report in reports)
    windows = [healthy_work(world, rng) for _ in range(MIN_NOISE_WINDOWS + 3)]
    for index in (MIN_NOISE_WINDOWS, MIN_NOISE_WINDOWS + 1):
        windows[index][world - 1] = {phase: 3 * seconds for phase, seconds in WORK.items()}
    verdicts = [named(report) for report in run(StragglerScores(top_k=3), windows)]
    assert verdicts == [[]] * (MIN_NOISE_WINDOWS + 1) + [[world - 1], []]


@pytest.mark.parametrize("world", [2, 4, 64])
def test_a_restart_keeps_the_own_best_and_learns_the_noise_again(world: int) -> None:
    rng = random.Random(world)

    def windows(count: int) -> list[dict[int, dict[str, float]]]:
        timeline = [healthy_work(world, rng) for _ in range(count)]
        for work in timeline:
            work[1]["optimizer"] += SLOW_S
        return timeline

    before = StragglerScores(top_k=3)
    assert named(run(before, windows(8))[-1]) == [1]
    state = json.loads(json.dumps(before.state_dict()))
    restored = StragglerScores(top_k=3)
    restored.load_state_dict(state)
    assert restored.state_dict() == before.state_dict()
    reports = run(restored, windows(8))
    for index, report in enumerate(reports):
        assert ("train/straggler/threshold" in report) == (index >= MIN_NOISE_WINDOWS - 1)
        assert named(report) == ([1] if index >= MIN_NOISE_WINDOWS else [])
    # The best windows before the restart still count: twice as slow as then scores 2.
    probe = StragglerScores(top_k=3)
    probe.load_state_dict(state)
    data = {int(rank): best for rank, best in state["data"].items()}
    report = probe.score({"data": {**data, 0: 2 * data[0]}}, 1.0)
    assert report["train/straggler/own_best_rank"]["data"] == 0.0
    assert report["train/straggler/own_best_score"]["data"] == 2.0


def test_on_two_ranks_a_far_slower_rank_is_named_however_its_peers_short_phase_jitters() -> None:
    """Rank 1 sleeps 100 ms in a forward of about 1 ms; rank 0's 1 ms moves by up to 5x from window
    to window on a busy host, and the score with it (20 to 100). No rank's score is within a
    factor 2 of 1, so nothing tells the noise: the threshold is its floor, and rank 1 is named."""
    scores = StragglerScores(top_k=1)
    peer = [0.001, 0.005, 0.002, 0.001, 0.004, 0.001, 0.003, 0.005]
    reports = [scores.score({"forward": {0: t, 1: 0.101}}, 0.11) for t in peer]
    for index, report in enumerate(reports):
        if index >= MIN_NOISE_WINDOWS - 1:
            floor = 1 + MIN_EXCESS_S / peer[index]
            assert report["train/straggler/threshold"]["forward"] == pytest.approx(floor)
        assert named(report) == ([1] if index >= MIN_NOISE_WINDOWS else [])


def test_a_noisy_host_raises_the_threshold_above_its_own_spikes() -> None:
    """Two healthy ranks on a shared host: whichever the neighbour slowed takes 1.6-1.7 times the
    other's time in a window, the other one in the next; the threshold rises with that spread."""
    scores = StragglerScores(top_k=3)
    slowed = [(1.0, 1.7), (1.6, 1.0), (1.0, 1.65), (1.7, 1.0), (1.0, 1.6), (1.65, 1.0), (1.0, 1.7)] * 2
    reports = [scores.score({"forward": {0: 0.1 * a, 1: 0.1 * b}}, 0.4) for a, b in slowed]
    for report in reports[MIN_NOISE_WINDOWS - 1 :]:
        assert report["train/straggler/score"]["forward"] < report["train/straggler/threshold"]["forward"]
        assert not named(report)
    assert all(report["train/straggler/score"]["forward"] >= 1.6 for report in reports)


def test_the_threshold_is_the_mean_change_factor_of_the_ranks_near_the_median_cubed() -> None:
    scores = StragglerScores(top_k=1)
    # Rank 2 barely enters the phase and rank 3 straggles: neither says how the others spread.
    windows = [{0: 1.0, 1: 1.0, 2: 0.01, 3: 9.0}, {0: 1.1, 1: 1.0, 2: 0.03, 3: 8.0}]
    windows += [{0: 1.0, 1: 1.1, 2: 0.01, 3: 9.5}, {0: 1.1, 1: 1.0, 2: 0.02, 3: 8.5}]
    for forward in windows:
        report = scores.score({"forward": forward}, 20.0)
    scored = [
        {rank: w[rank] / statistics.median(w[o] for o in w if o != rank) for rank in (0, 1)} for w in windows
    ]
    changes = [
        abs(math.log(now[r] / before[r])) for before, now in itertools.pairwise(scored) for r in (0, 1)
    ]
    expected = math.exp(NOISE_SPREADS * statistics.fmean(changes))
    assert report["train/straggler/threshold"]["forward"] == pytest.approx(max(expected, 1 + MIN_EXCESS))


def test_in_a_phase_of_a_millisecond_the_threshold_is_a_rank_2_ms_slower() -> None:
    scores = StragglerScores(top_k=1)
    for _ in range(MIN_NOISE_WINDOWS):
        report = scores.score({"optimizer": {0: 0.001, 1: 0.001, 2: 0.0025}}, 0.01)
    assert report["train/straggler/threshold"]["optimizer"] == pytest.approx(1 + MIN_EXCESS_S / 0.001)
    assert not named(report)  # 2.5 < 3, though it costs the others 15 % of the step


def test_a_straggler_that_costs_the_others_little_is_scored_but_not_named() -> None:
    scores = StragglerScores(top_k=2)
    for _ in range(MIN_NOISE_WINDOWS + 2):
        report = scores.score({"tiny": {0: 0.001, 1: 0.005, 2: 0.001}}, 0.2)
    assert report["train/straggler/rank"]["tiny"] == 1.0 and report["train/straggler/score"]["tiny"] == 5.0
    # 4 ms of a 200 ms step: the others wait 2 % of the step for rank 1.
    assert report["train/straggler/cost"]["tiny"] == pytest.approx(0.4 * MIN_COST)
    assert not named(report)


def test_a_rank_slower_than_its_own_best_is_seen_even_when_all_slow_down_together() -> None:
    scores = StragglerScores(top_k=3)
    scores.score({"forward": {0: 0.1, 1: 0.1}}, 1.0)
    report = scores.score({"forward": {0: 0.3, 1: 0.3}}, 1.0)
    assert report["train/straggler/score"] == {"forward": 1.0}
    assert report["train/straggler/own_best_score"] == {"forward": pytest.approx(3.0)}
    assert report["train/straggler/own_best_rank"] == {"forward": 0.0}  # lowest rank on ties


def test_phases_no_rank_spent_time_in_are_not_scored() -> None:
    assert StragglerScores(top_k=3).score({"forward": {0: 0.0, 1: 0.0}}, 1.0) == {}


@pytest.mark.parametrize("world", [2, 4, 64])
def test_a_straggler_that_recovers_is_cleared_by_an_empty_top_once(world: int) -> None:
    """Rank 1 straggles for 8 windows, then works as its peers: the first window that names nobody
    gives `top_rank` and `top_score` empty (a scrape endpoint, which keeps a name's last value, drops
    the last stragglers), the later ones leave them out."""
    rng = random.Random(world)
    slow = [healthy_work(world, rng) for _ in range(8)]
    for work in slow:
        work[1]["optimizer"] += SLOW_S
    reports = run(StragglerScores(top_k=3), [*slow, *(healthy_work(world, rng) for _ in range(8))])
    assert named(reports[7]) == [1]
    cleared = next(index for index, report in enumerate(reports) if index > 7 and not named(report))
    assert reports[cleared]["train/straggler/top_rank"] == reports[cleared]["train/straggler/top_score"] == {}
    for report in reports[cleared + 1 :]:
        assert "train/straggler/top_rank" not in report and "train/straggler/top_score" not in report


def test_the_rank_of_the_highest_lowest_and_median_value_is_the_lowest_rank_among_ties() -> None:
    from torchtelemetry.report.signals._base import highest_rank, lowest_rank, median_rank

    values = {3: 1.0, 1: 2.0, 0: 2.0, 2: 0.5, 6: 0.5}
    assert (highest_rank(values), lowest_rank(values), median_rank(values)) == (0, 2, 3)
    tied = {5: 1.0, 4: 1.0}
    assert (highest_rank(tied), lowest_rank(tied), median_rank(tied)) == (4, 4, 4)
    unbounded = {0: math.inf, 1: -math.inf}
    assert (highest_rank(unbounded), lowest_rank(unbounded)) == (0, 1)
    generator = random.Random(0)
    for _ in range(200):  # as the order by (value, rank) defines them, on values with many ties
        drawn = {rank: float(generator.randint(0, 3)) for rank in generator.sample(range(50), 9)}
        assert highest_rank(drawn) == max(drawn, key=lambda rank: (drawn[rank], -rank))
        assert lowest_rank(drawn) == min(drawn, key=lambda rank: (drawn[rank], rank))
        assert median_rank(drawn) == sorted(drawn, key=lambda rank: (drawn[rank], rank))[4]
    with pytest.raises(ValueError):
        highest_rank({})
