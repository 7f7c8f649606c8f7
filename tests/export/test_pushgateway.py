"""PushgatewayExporter against a real Pushgateway, scraped by a real Prometheus with honor_labels."""

from __future__ import annotations

import logging
import uuid

import pytest

from tests.distributed import free_port, run_ranks
from tests.export.scraped_run import (
    DESCRIPTORS,
    RUN,
    WORLD_SIZE,
    check_observations,
    sample_report,
    train_and_export,
)
from tests.servers import PrometheusServer, PushgatewayServer, http_get
from torchtelemetry import PushgatewayExporter
from torchtelemetry.export import ExportHub, ExportResult, RunInfo
from torchtelemetry.report import NameCollisionError


@pytest.mark.slow
def test_gloo_run_pushed_and_scraped_through_the_gateway(
    pushgateway: PushgatewayServer, prometheus: PrometheusServer
) -> None:
    run_id = f"push-{uuid.uuid4().hex[:8]}"
    prometheus.scrape("pushgateway", [pushgateway.address], honor_labels=True)
    prometheus.start()
    rank0, rank1 = run_ranks(
        train_and_export, WORLD_SIZE, "pushgateway", pushgateway.url, prometheus.url,
        f'job="torchtelemetry",run="{run_id}"', run_id,
        timeout_s=240,
    )  # fmt: skip
    check_observations(rank0)
    assert rank1["threads"] == []
    # close() pushed the final report once more, marked finished, and the gateway keeps it.
    assert pushgateway.groups_of(run_id) == [{"job": "torchtelemetry", "run": run_id}]
    assert (
        f'torchtelemetry_run_finished_timestamp_seconds{{instance="",job="torchtelemetry",route="pushgateway",run="{run_id}"}}'
        in (http_get(f"{pushgateway.url}/metrics").decode())
    )


def test_group_key_and_keep_on_close(pushgateway: PushgatewayServer) -> None:
    exporter = PushgatewayExporter(
        pushgateway.url, job="trainer", grouping_key={"node": "n1"}, keep_on_close=True
    )
    exporter.describe(DESCRIPTORS, RUN)
    assert exporter.grouping_key == {"node": "n1", "run": RUN.run_id}
    assert exporter.export(4, sample_report(4), 1700000000.0) is ExportResult.SUCCESS
    assert exporter.force_flush(5)
    exporter.close()
    (group,) = pushgateway.groups_of(RUN.run_id)
    assert group == {"job": "trainer", "node": "n1", "run": RUN.run_id}
    body = http_get(f"{pushgateway.url}/metrics").decode()
    assert (
        'torchtelemetry_train_step{instance="",job="trainer",node="n1",route="pushgateway",run="run-1"} 4'
        in body
    )
    assert (
        'torchtelemetry_grad_norm_bucket{instance="",job="trainer",node="n1",route="pushgateway",run="run-1",'
        'le="+Inf"} 10' in body
    )


def test_unreachable_gateway_fails_without_raising_and_recovers(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    exporter = PushgatewayExporter(f"http://127.0.0.1:{port}", timeout_s=2)
    hub = ExportHub([exporter], run=RUN)
    hub.describe(DESCRIPTORS)
    with caplog.at_level(logging.ERROR):
        for step in range(1, 4):
            hub.submit(step, sample_report(step))
        assert not hub.force_flush(10)  # the last push failed, the retry too
    assert hub.health()["pushgateway"].errors == 3
    push_errors = [r for r in caplog.records if "push failed" in r.getMessage()]
    assert len(push_errors) == 1  # once per burst, not once per report
    with PushgatewayServer(tmp_path / "late") as gateway:
        exporter.url = gateway.url
        assert hub.force_flush(10)  # the latest report is pushed again
        assert gateway.groups_of(RUN.run_id) != []
        hub.close(10)
        assert "torchtelemetry_run_finished_timestamp_seconds" in http_get(f"{gateway.url}/metrics").decode()


def test_bad_options_and_collisions() -> None:
    with pytest.raises(ValueError, match="grouping_key"):
        PushgatewayExporter("127.0.0.1:9091", grouping_key={"run": "x"})
    with pytest.raises(ValueError, match="timeout_s"):
        PushgatewayExporter("127.0.0.1:9091", timeout_s=0)
    with pytest.raises(ValueError, match=r"http://\*\*\*@gw:9091/\?token=\*\*\* has a query") as refused:
        PushgatewayExporter("http://u:pa55@gw:9091/?token=t0k3n")  # the push path would go after it
    assert "pa55" not in str(refused.value) and "t0k3n" not in str(refused.value)
    exporter = PushgatewayExporter("127.0.0.1:9091")
    with pytest.raises(NameCollisionError):
        exporter.describe([DESCRIPTORS[0], DESCRIPTORS[0].__class__("train.loss")], RUN)
    assert exporter.export(1, sample_report(1), 1.0) is ExportResult.FAILURE  # never described
    exporter.close()
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()


def test_a_launch_adopting_its_checkpoint_s_run_moves_its_group(pushgateway: PushgatewayServer) -> None:
    """Described again under the run it resumes (Telemetry.load_state_dict after a push), the exporter
    deletes the group it pushed under its own launch's id: no group is left behind to go stale."""
    launched, resumed = f"launch-{uuid.uuid4().hex[:8]}", f"run-{uuid.uuid4().hex[:8]}"
    exporter = PushgatewayExporter(pushgateway.url, job="trainer")
    exporter.describe(DESCRIPTORS, RunInfo(run_id=launched))
    assert exporter.export(1, sample_report(1), 1700000000.0) is ExportResult.SUCCESS
    assert pushgateway.groups_of(launched) == [{"job": "trainer", "run": launched}]
    exporter.describe(DESCRIPTORS, RunInfo(run_id=resumed))
    assert pushgateway.groups_once_deleted(launched) == []
    assert exporter.export(2, sample_report(2), 1700000001.0) is ExportResult.SUCCESS
    exporter.close()
    assert pushgateway.groups_of(resumed) == [{"job": "trainer", "run": resumed}]
