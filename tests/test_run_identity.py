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
    ],
)
def test_a_launcher_s_job_id_names_the_run(env: dict[str, str], expected: str) -> None:
    ranks = run_ranks(_identity, 2, env=env)
    assert ranks == [{"run_id": expected, "source": "launcher"}] * 2


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
        assert json.loads((tmp_path / name).read_text()) == {"run_id": run_id, "step": 19}

    resumed = run_ranks(_stages, 4, str(tmp_path), True, timeout_s=200)
    assert [rank["warnings"] for rank in resumed] == [[]] * 4
    assert [rank["run_id"] for rank in resumed] == run_ids
    # Each stage redoes steps 10 to 19 of its own progress.
    assert [(rank["restarts"], rank["recomputed"]) for rank in resumed] == [(1, 10)] * 4
