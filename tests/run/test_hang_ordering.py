"""Which rank a hang names, on synthetic timelines: heartbeats and the reader's clock given as data,
exact verdicts for 2 to 64 ranks (stuck, closed, frozen and dead ranks, the exporting rank seen from
the next rank, recovery, slow runs, the name staying put). tests/reliability/test_hangs.py runs one
end-to-end case of each with real processes."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from torchtelemetry.run import BeatLedger, Hang, RankBeat, Reading, find_hang, hang_values

PHASES = ("forward", "backward", "optimizer")
HANG_AFTER_S = 10.0
INTERVAL_S = 1.0
WORLDS = [2, 3, 8, 64]


class Timeline:
    """`world` ranks publishing every `INTERVAL_S` on a clock the test moves; `where[rank]` is what a
    rank publishes (step, phase), and a rank publishes only while `publishing`."""

    def __init__(self, world: int) -> None:
        self.now = 0.0
        self.world = world
        self.ledger = BeatLedger(range(world), started=0.0, hang_after_s=HANG_AFTER_S, join_s=30.0)
        self.where = dict.fromkeys(range(world), (0, "none"))
        self.since = dict.fromkeys(range(world), 0.0)
        self.count = dict.fromkeys(range(world), 0)
        self.publishing = set(range(world))
        self.named: int | None = None

    def move(self, rank: int, step: int, phase: str) -> None:
        """`rank` makes progress: it is now at `step` in `phase`."""
        self.where[rank], self.since[rank] = (step, phase), self.now

    def everyone(self, step: int, phase: str, ranks: Iterable[int] | None = None) -> None:
        for rank in range(self.world) if ranks is None else ranks:
            self.move(rank, step, phase)

    def run(self, seconds: float) -> Hang | None:
        """Let `seconds` pass, a heartbeat per interval from each rank publishing, and judge."""
        hang = None
        for _ in range(int(seconds / INTERVAL_S)):
            self.now += INTERVAL_S
            for rank in sorted(self.publishing):
                self.count[rank] += 1
                step, phase = self.where[rank]
                reading = Reading(self.count[rank], step, phase, self.now - self.since[rank])
                assert self.ledger.heard(rank, reading, self.now)
            hang = find_hang(self.ledger.beats(self.now), PHASES, HANG_AFTER_S, INTERVAL_S, self.named)
            self.named = hang.behind.rank if hang is not None else None
        return hang


def _named(hang: Hang | None) -> tuple[int, int, str, int]:
    assert hang is not None, "no hang found"
    return hang.behind.rank, hang.behind.step, hang.behind.phase, hang.lost_ranks


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_stuck_in_forward_is_named_not_the_ranks_waiting_in_the_all_reduce(world: int) -> None:
    timeline = Timeline(world)
    timeline.everyone(99, "backward")
    timeline.run(5)
    stuck = world - 1
    timeline.everyone(100, "backward", ranks=range(world - 1))
    timeline.move(stuck, 100, "forward")
    assert timeline.run(HANG_AFTER_S - INTERVAL_S) is None  # not yet hang_after_s
    assert _named(timeline.run(2 * INTERVAL_S)) == (stuck, 100, "forward", 0)


@pytest.mark.parametrize("world", WORLDS)
def test_a_slow_run_that_keeps_moving_is_never_a_hang(world: int) -> None:
    timeline = Timeline(world)
    for step in range(20):
        for phase in PHASES:
            timeline.everyone(step, phase)
            assert timeline.run(HANG_AFTER_S - INTERVAL_S) is None


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_left_the_loop_is_named_while_the_others_wait_at_a_later_point(world: int) -> None:
    """Uneven inputs: the last rank ran out of data and called close() at step 105 (it waits in the
    final collection, or is gone); the others wait in the all-reduce of step 105. The closed rank is
    named, and stays named for the whole hang whatever the others' times."""
    timeline = Timeline(world)
    leaving = world - 1
    timeline.everyone(105, "backward", ranks=range(world - 1))
    timeline.move(leaving, 105, "closed")
    assert timeline.run(HANG_AFTER_S - INTERVAL_S) is None
    verdicts = {_named(timeline.run(INTERVAL_S)) for _ in range(40)}
    assert verdicts == {(leaving, 105, "closed", 0)}
    timeline.publishing.discard(leaving)  # its close() returned: its last heartbeat said closed
    assert _named(timeline.run(3 * HANG_AFTER_S)) == (leaving, 105, "closed", 0)  # closed is never lost


@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_closing_is_no_hang(world: int) -> None:
    timeline = Timeline(world)
    timeline.everyone(50, "closed")
    assert timeline.run(3 * HANG_AFTER_S) is None
    timeline.publishing.clear()
    assert timeline.run(3 * HANG_AFTER_S) is None


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("last_seen", [(97, "optimizer"), (100, "forward")])
def test_a_frozen_rank_is_named_at_the_step_the_others_wait_in_never_its_stale_one(
    world: int, last_seen: tuple[int, str]
) -> None:
    """SIGSTOP (or a C call holding the GIL) in forward at step 100: its last heartbeat may be steps
    old. The others wait in step 100's all-reduce (and say so an interval late), so it did not reach
    that: from the first report on it is named at step 100, in the phase it was last seen entering
    when that was at step 100, else `unknown`; lost once its heartbeat is `hang_after_s` old."""
    timeline = Timeline(world)
    frozen = world // 2
    timeline.move(frozen, *last_seen)
    timeline.run(INTERVAL_S)
    timeline.publishing.discard(frozen)
    timeline.run(INTERVAL_S)
    timeline.everyone(100, "backward", ranks=set(range(world)) - {frozen})
    verdicts = [timeline.run(INTERVAL_S) for _ in range(int(3 * HANG_AFTER_S))]
    reported = [_named(verdict) for verdict in verdicts if verdict is not None]
    phase = last_seen[1] if last_seen[0] == 100 else "unknown"
    assert {named[:3] for named in reported} == {(frozen, 100, phase)}
    assert reported[-1][3] == 1 and len(reported) >= 2 * HANG_AFTER_S


@pytest.mark.parametrize("world", [world for world in WORLDS if world >= 3])
def test_a_dead_rank_is_named_before_a_rank_behind_it(world: int) -> None:
    """A rank that stopped publishing is what the others wait for, wherever they stopped."""
    timeline = Timeline(world)
    timeline.everyone(20, "backward")
    timeline.move(0, 19, "optimizer")  # behind, but alive
    timeline.move(world - 1, 20, "forward")
    timeline.run(INTERVAL_S)
    timeline.publishing.discard(world - 1)
    assert _named(timeline.run(HANG_AFTER_S + INTERVAL_S)) == (world - 1, 20, "forward", 1)


@pytest.mark.parametrize("world", WORLDS)
def test_a_hang_clears_once_every_rank_moves_and_a_frozen_rank_resumes(world: int) -> None:
    timeline = Timeline(world)
    frozen = 0
    timeline.everyone(7, "backward")
    timeline.move(frozen, 7, "forward")
    timeline.run(INTERVAL_S)
    timeline.publishing.discard(frozen)
    assert _named(timeline.run(HANG_AFTER_S + INTERVAL_S)) == (frozen, 7, "forward", 1)
    timeline.publishing.add(frozen)  # SIGCONT: it publishes again, then every rank moves
    timeline.everyone(8, "forward")
    assert timeline.run(INTERVAL_S) is None


def test_the_exporting_rank_seen_from_the_next_rank() -> None:
    """What the next rank judges when the exporting rank (0) stops: the exporting rank's stale
    heartbeat and its own, waiting in the all-reduce; rank 0 at the step rank 1 waits in."""
    ledger = BeatLedger([0], started=0.0, hang_after_s=HANG_AFTER_S, join_s=0.0)
    ledger.heard(0, Reading(5, 41, "optimizer", 0.2), now=1.0)
    own = RankBeat(1, 42, "backward", stalled_s=HANG_AFTER_S + 1.5)
    (leader,) = ledger.beats(now=1.0 + HANG_AFTER_S + 1.0)
    assert leader.lost
    hang = find_hang([leader, own], PHASES, HANG_AFTER_S, INTERVAL_S, named=0)
    assert _named(hang) == (0, 42, "unknown", 1)


def test_replayed_values_are_refused_and_counted_and_the_last_genuine_one_kept() -> None:
    ledger = BeatLedger([0, 1], started=0.0, hang_after_s=HANG_AFTER_S, join_s=5.0)
    genuine = [Reading(count, 3, "forward", 0.0) for count in (1, 2, 3)]
    for second, reading in enumerate(genuine, 1):
        assert ledger.heard(0, reading, float(second))
    assert ledger.heard(0, genuine[2], 4.0)  # the same value read again: no news, no replay
    assert not ledger.heard(0, genuine[0], 5.0)
    assert not ledger.heard(0, Reading(3, 9, "optimizer", 0.0), 5.0)  # same count, other content
    ledger.refused()  # a forged or malformed value
    assert ledger.rejected == 3
    (beat,) = ledger.beats(6.0)
    assert (beat.rank, beat.step, beat.phase, beat.stalled_s) == (0, 3, "forward", 3.0)
    assert ledger.unwatched(4.9) == [] and ledger.unwatched(5.0) == [1]


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_never_joined_are_unwatched_not_lost(world: int) -> None:
    timeline = Timeline(world)
    timeline.publishing.discard(world - 1)
    for step in range(int(3 * HANG_AFTER_S)):
        timeline.everyone(step, "forward", ranks=range(world - 1))
        assert timeline.run(INTERVAL_S) is None
    assert timeline.ledger.unwatched(timeline.now) == [world - 1]


def test_the_report_that_clears_a_hang_has_no_phase_and_zero_seconds() -> None:
    values = hang_values(None, rejected=2, unwatched_ranks=1)
    assert values["train/hang/seconds"] == 0 and values["train/hang/phase"] == {}
    assert values["train/hang/rejected_values"] == 2 and values["train/hang/unwatched_ranks"] == 1
    assert "train/hang/rank" not in values  # rank and step keep naming the last hang
