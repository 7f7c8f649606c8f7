"""The heartbeat and the hang report: where the training thread says it is, which rank a hang names,
recovery, one stack file per hang, and no collective added to a window (tests/reliability/
test_hangs.py has the multi-rank hangs)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.report import RankBeat, find_hang, hang_values

PHASES = ("forward", "backward", "optimizer")


def _beat(rank: int, step: int, phase: str, stalled_s: float, lost: bool = False) -> RankBeat:
    return RankBeat(rank, step, phase, stalled_s, lost=lost)


def test_no_hang_while_every_rank_moved_within_hang_after_s() -> None:
    beats = [_beat(0, 5, "backward", 9.9), _beat(1, 5, "forward", 1.0)]
    assert find_hang(beats, PHASES, hang_after_s=10) is None


def test_the_rank_furthest_behind_is_named_by_step_then_phase_order_then_time_stuck() -> None:
    beats = [
        _beat(0, 5, "backward", 30),
        _beat(1, 5, "forward", 12),
        _beat(2, 5, "forward", 20),
        _beat(3, 6, "data", 40),
    ]
    hang = find_hang(beats, PHASES, hang_after_s=10)
    assert hang is not None and hang.behind.rank == 2 and hang.lost_ranks == 0
    beats.append(_beat(4, 4, "collect", 11))
    assert find_hang(beats, PHASES, hang_after_s=10).behind.rank == 4
    # Not in a phase comes first within a step: the rank has not started its step's work.
    beats.append(_beat(5, 4, "none", 11))
    assert find_hang(beats, PHASES, hang_after_s=10).behind.rank == 5


def test_a_lost_rank_is_named_before_the_ranks_that_wait_for_it() -> None:
    beats = [_beat(0, 3, "none", 15), _beat(1, 3, "none", 15), _beat(2, 3, "forward", 16, lost=True)]
    hang = find_hang(beats, PHASES, hang_after_s=10)
    assert hang is not None and hang.behind.rank == 2 and hang.lost_ranks == 1
    values = hang_values(hang)
    assert values["train/hang/phase"] == {"forward": 1.0} and values["train/hang/lost_ranks"] == 1


def test_the_report_that_clears_a_hang_has_no_phase_and_zero_seconds() -> None:
    values = hang_values(None)
    assert values["train/hang/seconds"] == 0 and values["train/hang/phase"] == {}
    assert "train/hang/rank" not in values  # rank and step keep naming the last hang


@pytest.mark.parametrize(
    "fields",
    [{"hang_after_s": 0}, {"hang_after_s": -1.0}, {"heartbeat_interval_s": 0}, {"hang_after_s": 1.0}],
)
def test_bad_hang_settings_name_the_key(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=f"TelemetryConfig.{next(iter(fields))}"):
        tt.TelemetryConfig(**fields)


def test_hang_after_s_none_turns_the_heartbeat_off() -> None:
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, hang_after_s=None)
    try:
        assert telemetry._hang_watch is None
        assert not any(d.name.startswith("train/hang/") for d in telemetry.descriptors)
    finally:
        telemetry.close()


def test_the_training_thread_says_where_it_is_in_step_phase_data_wait_and_collection() -> None:
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, every=2)
    beat = telemetry._hang_watch.beat
    try:
        assert beat.where()[:2] == (0, "none")
        with telemetry.data_wait():
            assert beat.where()[:2] == (0, "data")
        with telemetry.phase("forward"):
            with telemetry.phase("backward"):
                assert beat.where()[:2] == (0, "backward")
            assert beat.where()[:2] == (0, "forward")
        progress = beat.where()[2]
        telemetry.step(0)
        assert beat.where() == (1, "none", progress)
        telemetry.step(1)  # schedules a window
        seen = []
        telemetry._windows._collector.collect_results = _watching(
            telemetry._windows._collector.collect_results, lambda: seen.append(beat.where()[1])
        )
        telemetry.flush()
        assert seen == ["collect"] and beat.where()[1] == "none"
    finally:
        telemetry.close()


def test_a_phase_entered_again_is_progress_and_phases_record_nothing_for_the_heartbeat() -> None:
    """Micro-batches enter the same phase again and again within one step: each entry is progress.
    The timers hold no heartbeat to write to: the heartbeat reads their own state."""
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, every=2)
    beat = telemetry._hang_watch.beat
    try:
        seen = []
        for _ in range(3):
            with telemetry.phase("forward"):
                seen.append(beat.where())
            seen.append(beat.where())
        assert [where[:2] for where in seen] == [(0, "forward"), (0, "none")] * 3
        assert len({where[2] for where in seen}) == len(seen), "an entry or exit was not progress"
        for timer in beat.timers:
            assert not hasattr(timer, "beat")
    finally:
        telemetry.close()


def _watching(method: Callable[[], object], before: Callable[[], None]) -> Callable[[], object]:
    def watched() -> object:
        before()
        return method()

    return watched


def _reports(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["values"] for line in lines if line.endswith("}")]


def _wait_for(what: str, found: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not found():
        assert time.monotonic() < deadline, f"no {what} within 60 s"
        time.sleep(0.05)


def test_a_stuck_phase_is_reported_once_dumped_and_cleared_when_it_moves_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    release, finish = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def train() -> None:  # the training thread: builds the Telemetry, gets stuck, moves on
        try:
            with tt.Telemetry(
                {"loss": tt.SumMetric()},
                [tt.JsonlExporter(path)],
                run_id="stuck",
                hang_after_s=0.4,
                heartbeat_interval_s=0.1,
                dump_dir=tmp_path,
            ) as telemetry:
                telemetry.step(0)
                with telemetry.phase("optimizer"):
                    release.wait(120)
                telemetry.step(1)
                finish.wait(120)
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        _wait_for("hang report", lambda: any(r.get("train/hang/dump") for r in _reports(path)))
        hung = next(r for r in _reports(path) if r.get("train/hang/dump"))
        assert (hung["train/hang/rank"], hung["train/hang/step"]) == (0, 1)
        assert hung["train/hang/phase"] == {"optimizer": 1.0}
        release.set()
        _wait_for("cleared report", lambda: _reports(path)[-1].get("train/hang/seconds") == 0)
        assert _reports(path)[-1]["train/hang/phase"] == {}
    finally:
        release.set()
        finish.set()
        thread.join(60)
    assert not failures
    (dump,) = tmp_path.glob("torchtelemetry-hang-*")  # one file, however many heartbeats saw the hang
    assert dump.name == "torchtelemetry-hang-stuck-rank0-step1.txt"
    assert "in phase 'optimizer'" in dump.read_text() and "in train" in dump.read_text()


def _collectives() -> int:
    return sum(group._get_sequence_number_for_group() for group in dist.distributed_c10d._world.pg_map)


def _count_collectives(rank: int, world_size: int, hang_after_s: float | None) -> int:
    telemetry = tt.Telemetry(
        {"loss": tt.SumMetric()}, every=2, hang_after_s=hang_after_s, heartbeat_interval_s=0.05
    )
    telemetry.flush()
    before = _collectives()
    for step in range(8):
        with telemetry.phase("forward"):
            telemetry.metrics["loss"].update(torch.tensor(1.0))
        telemetry.step(step)
        time.sleep(0.01)  # let the heartbeat threads publish between steps
    telemetry.flush()
    counted = _collectives() - before
    telemetry.close()
    return counted


@pytest.mark.timeout(300)
def test_the_heartbeat_adds_no_collective_to_a_window() -> None:
    with_heartbeat = run_ranks(_count_collectives, 2, 5.0)
    without = run_ranks(_count_collectives, 2, None)
    assert with_heartbeat == without == [4, 4]  # four windows, one collective each
