"""Building `Telemetry` is collective: on real gloo ranks, a rank that fails or never builds it is
reported on every rank within `timeout_s`, never a hang or a raw gloo error."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import RankFailed, run_ranks
from tests.receivers import OtlpHttpReceiver, metrics_by_name, resource_attributes

START_TIMEOUT_S = 3.0


def _build_on_rank_zero_only(rank: int, world_size: int) -> str:
    if rank != 0:
        time.sleep(3 * START_TIMEOUT_S)  # "training" on, never building the Telemetry
        return "not built"
    try:
        tt.Telemetry({"loss": tt.WeightedMeanMetric()}, [], timeout_s=START_TIMEOUT_S)
    except tt.TelemetryStartupError as error:
        return str(error)
    return "built"


@pytest.mark.timeout(120)
def test_building_on_rank_zero_only_raises_a_clear_error_within_timeout_s() -> None:
    # pg_timeout_s far above timeout_s: without the bounded start-up, rank 0 waits in the
    # default group's collective for 60 s and ends with a raw gloo error.
    message, _ = run_ranks(_build_on_rank_zero_only, 2, pg_timeout_s=60.0, timeout_s=90.0)
    # Rank 1 never built it, so it cannot raise; rank 0 names it (it named no rank).
    assert "rank 0 of 2): ranks [1] did not build it within timeout_s=3s" in message
    assert "build it on every rank" in message


def _build_with_one_rank_failing(rank: int, world_size: int, failing_rank: int) -> None:
    if failing_rank == 0:
        # Only rank 0 starts (describes) its exporters: a Prometheus-only name collision fails there alone.
        metrics, exporters = {"a/b": tt.SumMetric(), "a_b": tt.SumMetric()}, [tt.PrometheusExporter(port=0)]
    else:
        # An exporter spec only rank 1 cannot resolve (a node without the extra, say).
        metrics, exporters = {"loss": tt.WeightedMeanMetric()}, "nosuch" if rank == 1 else "console"
    tt.Telemetry(metrics, exporters, timeout_s=30.0, signals=False).close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("failing_rank", "cause"),
    [(0, "NameCollisionError: Prometheus: metric names collide"), (1, "unknown exporter(s) ['nosuch']")],
)
def test_a_rank_that_fails_to_start_makes_every_rank_raise_naming_it(failing_rank: int, cause: str) -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_build_with_one_rank_failing, 2, failing_rank, timeout_s=90.0)
    errors = failed.value.errors
    assert sorted(errors) == [0, 1], "every rank raised, none trained on or hung"
    other = 1 - failing_rank
    assert errors[other].startswith("TelemetryStartupError")
    assert f"rank {failing_rank}: " in errors[other] and cause in errors[other]
    assert cause in errors[failing_rank]
    assert f"failed to start on rank {failing_rank} of 2" in errors[failing_rank]


def test_world_size_without_a_process_group_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 .*call torch.distributed.init_process_group\(\)"):
        tt.Telemetry({"loss": tt.WeightedMeanMetric()}, [])
    monkeypatch.setenv("WORLD_SIZE", "1")
    tt.Telemetry({"loss": tt.WeightedMeanMetric()}, []).close()


# -- who exports: rank 0 of each group ---------------------------------------------------------------


def _stage_groups(rank: int) -> tuple[int, Any]:
    """Two pipeline stages of 2 ranks: every rank creates both groups (new_group is collective)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return rank // 2, groups[rank // 2]


def _pipeline_rank(rank: int, world_size: int, endpoint: str) -> dict[str, Any]:
    stage, group = _stage_groups(rank)
    metrics = {f"stage{stage}": {"loss": tt.WeightedMeanMetric()}}
    exporter = tt.OTelExporter(endpoint=endpoint, timeout_s=10)
    with tt.Telemetry(
        metrics, [exporter], group=group, every=2, run_id="pipeline", signals=False, timeout_s=30
    ) as telemetry:
        for step in range(4):
            metrics[f"stage{stage}"]["loss"].update(1.0 if stage == 0 else 8.0)
            telemetry.step(step)
    return {"exporting": telemetry.is_exporting, "run_id": telemetry.run.run_id}


@pytest.mark.timeout(180)
def test_every_group_s_rank_zero_exports_its_group_under_a_run_id_naming_it() -> None:
    with OtlpHttpReceiver() as receiver:
        ranks = run_ranks(_pipeline_rank, 4, receiver.metrics_endpoint, timeout_s=150)
        received = receiver.received
    assert [r["exporting"] for r in ranks] == [True, False, True, False]
    assert [r["run_id"] for r in ranks] == ["pipeline-group0"] * 2 + ["pipeline-group2"] * 2
    losses: dict[str, list[float]] = {}
    for request in received:
        (resource,) = resource_attributes(request.request)
        for name, metric in metrics_by_name(request.request).items():
            if name.endswith(".loss"):
                losses.setdefault(f"{resource['service.instance.id']}: {name}", []).append(
                    metric.gauge.data_points[0].as_double
                )
    assert losses == {"pipeline-group0: stage0.loss": [1.0, 1.0], "pipeline-group2: stage1.loss": [8.0, 8.0]}


def _outside_its_group(rank: int, world_size: int) -> None:
    group = dist.new_group([0, 1])  # ranks 2 and 3 are in no group of theirs
    tt.Telemetry({"loss": tt.WeightedMeanMetric()}, [], group=group, timeout_s=30, signals=False).close()


@pytest.mark.timeout(180)
def test_a_rank_outside_the_group_it_is_given_is_refused_on_every_rank() -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_outside_its_group, 4, timeout_s=150)
    errors = failed.value.errors
    assert sorted(errors) == [0, 1, 2, 3], "every rank raised at construction"
    for rank in (2, 3):
        assert errors[rank].startswith("ValueError"), errors[rank]
        assert f"rank {rank} is not in group=" in errors[rank] and "nothing would ever export" in errors[rank]
    for rank in (0, 1):
        assert errors[rank].startswith("TelemetryStartupError") and "rank 2: ValueError" in errors[rank]
