"""The heartbeat and the hang report in one process: where the training thread says it is, the
settings refused, a hang reported, dumped and cleared (also just before close()), stack files that
cannot be redirected, and no collective added to a window (tests/run/ has the ordering on synthetic
timelines and the store; tests/reliability/test_hangs.py the multi-rank hangs)."""

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


@pytest.mark.parametrize(
    "fields",
    [
        {"hang_after_s": 0},
        {"hang_after_s": -1.0},
        {"heartbeat_interval_s": 0},
        {"hang_after_s": 1.0},
        {"heartbeat_port": -1},
        {"heartbeat_port": 70000},
    ],
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
    beat = telemetry._hang_watch.publisher.beat
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
        telemetry.step(2)
    finally:
        telemetry.close()
    assert seen == ["collect", "closed"]  # close() collects the last window as a rank that left the loop
    assert beat.where()[:2] == (3, "closed")


def test_a_phase_entered_again_is_progress_and_phases_record_nothing_for_the_heartbeat() -> None:
    """Micro-batches enter the same phase again and again within one step: each entry is progress.
    The timers hold no heartbeat to write to: the heartbeat reads their own state."""
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, every=2)
    beat = telemetry._hang_watch.publisher.beat
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


def _watched(directory: Path, **fields: object) -> tt.Telemetry:
    """A Telemetry exporting to `directory`/metrics.jsonl, dumping to `directory`, a hang after 0.4 s
    (heartbeats every 0.1 s) unless `fields` say otherwise."""
    settings = {"hang_after_s": 0.4, "heartbeat_interval_s": 0.1, "dump_dir": directory, **fields}
    return tt.Telemetry({"loss": tt.SumMetric()}, [tt.JsonlExporter(directory / "metrics.jsonl")], **settings)


def _in_a_training_thread(train: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Start `train` on a thread of its own (it builds its Telemetry: the training thread)."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            train()
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failures


def _hung(path: Path, seen: set[str] = frozenset()) -> dict:
    """The first hang report in `path` naming a stack file not in `seen` (waited for, bounded)."""

    def new() -> list[dict]:
        return [
            r for r in _reports(path) if r.get("train/hang/dump") and not set(r["train/hang/dump"]) & seen
        ]

    _wait_for("hang report", lambda: bool(new()))
    return new()[0]


def test_a_stuck_phase_is_reported_once_dumped_and_cleared_when_it_moves_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    release, finish = threading.Event(), threading.Event()

    def train() -> None:  # the training thread: builds the Telemetry, gets stuck, moves on
        with _watched(tmp_path, run_id="stuck") as telemetry:
            telemetry.step(0)
            with telemetry.phase("optimizer"):
                release.wait(120)
            telemetry.step(1)
            finish.wait(120)

    thread, failures = _in_a_training_thread(train)
    try:
        hung = _hung(path)
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
    # The stacks are the hang's capture, one however many heartbeats saw the hang, named by the report.
    (capture,) = tmp_path.glob("torchtelemetry-capture-*")
    assert capture.name == "torchtelemetry-capture-stuck-rank0-step1-hang"
    assert [path.name for path in capture.iterdir()] == ["stacks.txt"] and not list(tmp_path.glob("*.txt"))
    dump = capture / "stacks.txt"
    assert "in phase 'optimizer'" in dump.read_text() and "in train" in dump.read_text()
    assert hung["train/hang/dump"] == {str(dump): 0.0}
    assert hung["train/capture/file"] == {str(capture): 1.0}
    assert (hung["train/capture/rank"], hung["train/capture/step"]) == (0, 1)
    windows = [report for report in _reports(path) if "train/capture/count" in report]
    assert windows[-1]["train/capture/count"]["hang"] == 1  # counted with the next window


def test_a_hang_that_clears_just_before_close_is_cleared_in_the_final_report(tmp_path: Path) -> None:
    """The monitor reads once a heartbeat interval (here 5 s): a hang that clears right before
    close() is seen cleared by close()'s own last look, so no export ends on a hang."""
    path = tmp_path / "metrics.jsonl"
    reported = threading.Event()

    def train() -> None:
        with _watched(tmp_path, hang_after_s=10.0, heartbeat_interval_s=5.0) as telemetry:
            telemetry.step(0)
            with telemetry.phase("forward"):
                reported.wait(120)
            telemetry.step(1)  # moves again, and closes within the same interval

    thread, failures = _in_a_training_thread(train)
    try:
        _hung(path)
    finally:
        reported.set()
        thread.join(60)
    assert not failures
    last = [values for values in _reports(path) if "train/hang/seconds" in values][-1]
    assert last["train/hang/seconds"] == 0 and last["train/hang/phase"] == {}


@pytest.mark.parametrize("capture_on", [(), ("hang",)])
def test_a_planted_symlink_is_never_followed_and_two_hangs_in_one_step_get_two_files(
    tmp_path: Path, capture_on: tuple[str, ...]
) -> None:
    """Stack files are opened O_CREAT|O_EXCL|O_NOFOLLOW, 0600: the name a symlink took is skipped
    (its target untouched), a second hang in the same step gets its own file, and each report names
    the file that exists. With hang captures, a symlink planted at the capture directory's name is
    never followed either: the stacks go to stack files, and the capture counts as failed."""
    path = tmp_path / "metrics.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "torchtelemetry-hang-planted-rank0-step1-1.txt").symlink_to(victim)
    (tmp_path / "torchtelemetry-capture-planted-rank0-step1-hang").symlink_to(tmp_path)
    releases = [threading.Event(), threading.Event()]

    def train() -> None:
        with _watched(tmp_path, run_id="planted", capture_on=capture_on) as telemetry:
            telemetry.step(0)
            for release in releases:  # two hangs in step 1
                with telemetry.phase("optimizer"):
                    release.wait(120)
            telemetry.step(1)

    thread, failures = _in_a_training_thread(train)
    files: list[str] = []
    try:
        for release in releases:
            (file,) = _hung(path, set(files))["train/hang/dump"]
            files.append(file)
            release.set()
    finally:
        for release in releases:
            release.set()
        thread.join(60)
    assert not failures
    assert victim.read_text() == "keep me"
    assert [Path(file).name for file in files] == [
        "torchtelemetry-hang-planted-rank0-step1-2.txt",
        "torchtelemetry-hang-planted-rank0-step1-3.txt",
    ]
    for file in files:
        assert Path(file).stat().st_mode & 0o777 == 0o600
        assert "in phase 'optimizer'" in Path(file).read_text()
    windows = [report for report in _reports(path) if "train/capture/count" in report]
    failed = windows[-1]["train/capture/count"]["failed"] if capture_on else 0.0
    assert failed == (2.0 if capture_on else 0.0)  # each hang's capture directory, with the next window


@pytest.mark.parametrize("reserved", ["none", "collect", "closed", "unknown"])
def test_phase_names_that_are_heartbeat_labels_are_refused_naming_the_clash(reserved: str) -> None:
    with pytest.raises(
        ValueError, match=f"TelemetryConfig.phases: \\['{reserved}'\\] are labels of the hang"
    ):
        tt.TelemetryConfig(phases=("forward", reserved))


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
