"""A run outlives its processes (issue 31): every rank agrees on one run id at start-up, found
without the user (launcher, progress file, checkpoint), and each group's exporting rank alone writes
its own progress file, so ranks and pipeline stages sharing a directory never collide."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.run import launcher_run_id


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _identity(rank: int, world_size: int) -> dict[str, Any]:
    with tt.Telemetry({"loss": tt.WeightedMeanMetric()}, signals=False) as telemetry:
        return {"run_id": telemetry.run.run_id, "source": telemetry.run_identity.source}


@pytest.mark.timeout(120)
def test_every_rank_takes_rank_zero_s_run_id() -> None:
    ranks = run_ranks(_identity, 2)
    assert ranks[0] == ranks[1] and ranks[0]["source"] == "new"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "2"}, "slurm-4711"),
        ({"TORCHELASTIC_RUN_ID": "rdzv-7", "SLURM_JOB_ID": "4711"}, "rdzv-7"),
        ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "4711"}, "slurm-4711"),
        ({"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "1"}, "slurm-4711.1"),
        (
            {"SLURM_JOB_ID": "4725", "SLURM_ARRAY_JOB_ID": "4711", "SLURM_ARRAY_TASK_ID": "3"},
            "slurm-4711_3",
        ),
    ],
)
def test_a_launcher_s_job_id_names_the_run(env: dict[str, str], expected: str) -> None:
    ranks = run_ranks(_identity, 2, env=env)
    assert ranks == [{"run_id": expected, "source": "launcher"}] * 2


@pytest.mark.timeout(120)
def test_two_srun_steps_of_one_allocation_are_two_runs() -> None:
    """Two `srun` runs in one allocation (steps 0 and 1 of job 4711) used to export as one run,
    `slurm-4711`, the second replacing the first's Pushgateway group."""
    allocation = {"SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "0"}
    first = run_ranks(_identity, 2, env={**allocation, "SLURM_STEP_ID": "0"})
    second = run_ranks(_identity, 2, env={**allocation, "SLURM_STEP_ID": "1"})
    assert first == [{"run_id": "slurm-4711.0", "source": "launcher"}] * 2
    assert second == [{"run_id": "slurm-4711.1", "source": "launcher"}] * 2


def test_the_launcher_id_tells_steps_and_array_tasks_apart_and_survives_a_requeue() -> None:
    job = {"SLURM_JOB_ID": "4711"}
    assert launcher_run_id(job) == "slurm-4711"  # the batch script
    assert launcher_run_id({**job, "SLURM_STEP_ID": "0"}) == "slurm-4711.0"
    assert launcher_run_id({**job, "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "3"}) == "slurm-4711.0"
    tasks = [
        launcher_run_id(
            {"SLURM_JOB_ID": str(4712 + task), "SLURM_ARRAY_JOB_ID": "4711", "SLURM_ARRAY_TASK_ID": str(task)}
        )
        for task in range(3)
    ]
    assert tasks == ["slurm-4711_0", "slurm-4711_1", "slurm-4711_2"]
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "rdzv-7", **job, "SLURM_STEP_ID": "0"}) == "rdzv-7"
    assert launcher_run_id({}) is None


def _run(progress: Path, steps: int = 2) -> tt.Telemetry:
    """A run with `progress` as its progress file, trained for `steps` steps (every window written)."""
    metrics = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, signals=False, every=1, progress_file=progress)
    for step in range(steps):
        metrics["loss"].update(torch.tensor(1.0), 1)
        telemetry.step(step)
    telemetry.flush()
    return telemetry


def test_a_fresh_run_beside_a_finished_run_s_progress_file_is_a_new_run(tmp_path: Path) -> None:
    """A finished run's file used to lend its id to the next run started in the same directory."""
    progress = tmp_path / "progress.json"
    finished = _run(progress)
    finished.close()
    assert json.loads(progress.read_text()) == {"run_id": finished.run.run_id, "step": 1, "finished": True}
    fresh = _run(progress)
    fresh.close()
    assert fresh.run_identity.source == "new"
    assert fresh.run.run_id != finished.run.run_id
    assert json.loads(progress.read_text())["run_id"] == fresh.run.run_id


def test_a_launch_beside_a_crashed_run_s_progress_file_continues_that_run(tmp_path: Path) -> None:
    """A run that never reached close() (killed, or its with block raised) did not finish: the next
    launch in its directory is its next attempt, before any checkpoint is loaded."""
    progress = tmp_path / "progress.json"
    crashed = _run(progress)
    crashed._progress.file.close()  # what a SIGKILL leaves: the last window's record, no end
    assert json.loads(progress.read_text()) == {"run_id": crashed.run.run_id, "step": 1, "finished": False}
    resumed = _run(progress)
    assert resumed.run_identity == tt.RunIdentity(crashed.run.run_id, "progress_file")
    with pytest.raises(RuntimeError, match="diverged"), resumed:
        raise RuntimeError("diverged")
    assert json.loads(progress.read_text())["finished"] is False
    again = _run(progress)
    again.close()
    assert again.run.run_id == crashed.run.run_id
    crashed.close()


def _attempts(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Two launches of one run, without run_id= or a progress file: the second adopts the first's id
    from the checkpoint, before it exports anything."""
    first_out, second_out = Path(directory) / "first.jsonl", Path(directory) / "second.jsonl"
    metrics = {"loss": tt.WeightedMeanMetric()}
    with tt.Telemetry(metrics, [tt.JsonlExporter(first_out)], every=2) as first:
        for step in range(4):
            metrics["loss"].update(torch.tensor(1.0), 1)
            first.step(step)
        state = first.state_dict()
    with tt.Telemetry(metrics, [tt.JsonlExporter(second_out)], every=2) as second:
        launched = second.run.run_id
        second.load_state_dict(state)
        for step in range(4, 6):
            metrics["loss"].update(torch.tensor(1.0), 1)
            second.step(step)
        second.flush()
        restarts = second.latest["train/goodput/restarts"]
    return {
        "first": first.run.run_id,
        "launched": launched,
        "second": second.run_identity,
        "restarts": restarts,
    }


@pytest.mark.timeout(120)
def test_a_launch_resumed_from_a_checkpoint_continues_its_run(tmp_path: Path) -> None:
    ranks = run_ranks(_attempts, 2, str(tmp_path))
    assert ranks[0] == ranks[1]
    (rank,) = ranks[:1]
    assert rank["launched"] != rank["first"]
    assert rank["second"] == tt.RunIdentity(rank["first"], "checkpoint")
    assert rank["restarts"] == 1
    for name in ("first.jsonl", "second.jsonl"):
        run_ids = {json.loads(line)["run_id"] for line in (tmp_path / name).read_text().splitlines()}
        assert run_ids == {rank["first"]}, name


def _stages(rank: int, world_size: int, directory: str, resume: bool) -> dict[str, Any]:
    """Two pipeline stages of 2 ranks with one progress_file in a shared directory; the second launch
    resumes each stage from its checkpoint at step 9 after the first got to step 19."""
    warnings = _Warnings()
    logging.getLogger("torchtelemetry").addHandler(warnings)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = rank // 2
    metrics = {f"stage{stage}": {"loss": tt.WeightedMeanMetric()}}
    checkpoint = Path(directory) / f"stage{stage}-rank{rank}.pt"
    with tt.Telemetry(
        metrics, group=groups[stage], every=5, progress_file=Path(directory) / "progress.json"
    ) as telemetry:
        first = 0
        if resume:
            telemetry.load_state_dict(torch.load(checkpoint, weights_only=False))
            first = 10
        for step in range(first, 20):
            metrics[f"stage{stage}"]["loss"].update(torch.tensor(1.0), 1)
            telemetry.step(step)
            if step == 9 and not resume:
                torch.save(telemetry.state_dict(), checkpoint)
                telemetry.checkpoint_saved(step)
        telemetry.flush()
        latest = dict(telemetry.latest)
    return {
        "run_id": telemetry.run.run_id,
        "recomputed": latest["train/goodput/recomputed_steps"],
        "restarts": latest["train/goodput/restarts"],
        "warnings": warnings.messages,
    }


@pytest.mark.timeout(240)
def test_pipeline_stages_sharing_a_directory_each_keep_their_own_progress(tmp_path: Path) -> None:
    killed = run_ranks(_stages, 4, str(tmp_path), False, timeout_s=200)
    assert [rank["warnings"] for rank in killed] == [[]] * 4
    run_ids = [rank["run_id"] for rank in killed]
    assert run_ids[0] == run_ids[1] and run_ids[2] == run_ids[3]
    base = run_ids[0].removesuffix("-group0")
    assert run_ids == [f"{base}-group0"] * 2 + [f"{base}-group2"] * 2
    files = sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("progress"))
    assert files == ["progress-group0.json", "progress-group2.json"]
    for name, run_id in (("progress-group0.json", run_ids[0]), ("progress-group2.json", run_ids[2])):
        assert json.loads((tmp_path / name).read_text()) == {"run_id": run_id, "step": 19, "finished": True}

    resumed = run_ranks(_stages, 4, str(tmp_path), True, timeout_s=200)
    assert [rank["warnings"] for rank in resumed] == [[]] * 4
    assert [rank["run_id"] for rank in resumed] == run_ids
    # Each stage redoes steps 10 to 19 of its own progress.
    assert [(rank["restarts"], rank["recomputed"]) for rank in resumed] == [(1, 10)] * 4
