"""Prometheus config and alert rules: promtool accepts them, they fire when they should, names are real."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.servers import PrometheusServer, binary, http_get
from tests.stack._stack import (
    ALERTS,
    ALERTS_TEST,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DIR,
    PROMETHEUS_HOST_CONFIG,
    alert_rules,
    emitted_labels,
    emitted_names,
    load_yaml,
    queried_labels,
    queried_metrics,
)
from torchtelemetry import PrometheusExporter, Telemetry, WeightedMeanMetric

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)"
)


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120, check=False
    )


@needs_promtool
def test_promtool_accepts_the_config_and_its_rule_files() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


@needs_promtool
def test_promtool_accepts_the_config_for_a_prometheus_outside_docker() -> None:
    result = _promtool("check", "config", str(PROMETHEUS_HOST_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(binary("prometheus") is None, reason="prometheus not installed")
def test_a_real_prometheus_outside_docker_scrapes_the_trainer_and_loads_every_alert(tmp_path) -> None:
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"train": {"loss": WeightedMeanMetric()}}, [exporter], every=1, run_id="host")
    telemetry.step(0)
    telemetry.flush()
    # The shipped file, with the trainer's port as it is in this test.
    config = PROMETHEUS_HOST_CONFIG.read_text().replace("127.0.0.1:9464", f"127.0.0.1:{exporter.port}")
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    try:
        with _ShippedConfigPrometheus(tmp_path, config) as prometheus:
            assert prometheus.wait_for('torchtelemetry_train_step{job="torchtelemetry", run="host"}')
            rules = json.loads(http_get(f"{prometheus.url}/api/v1/rules"))["data"]["groups"]
            loaded = {rule["name"] for group in rules for rule in group["rules"]}
            assert loaded == {rule["alert"] for rule in alert_rules()}
    finally:
        telemetry.close()


class _ShippedConfigPrometheus(PrometheusServer):
    """The test run's Prometheus, started on a given config instead of its own."""

    def __init__(self, workdir: Path, config: str) -> None:
        self._shipped = config
        super().__init__(workdir)

    def _write_config(self) -> None:
        self._config.write_text(self._shipped)


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(alert_rules())} rules found" in result.stdout


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    """Stalled (old timestamp, frozen step), data wait (both shapes), loss not finite,
    allocator retries and OOMs, export errors/drops."""
    result = _promtool("test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_proven_to_fire_and_to_stay_quiet() -> None:
    tests = load_yaml(ALERTS_TEST)["tests"]
    fired, quiet = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names == fired, f"alerts never shown to fire: {sorted(names - fired)}"
    assert names == quiet, f"alerts never shown to stay quiet: {sorted(names - quiet)}"
    assert load_yaml(ALERTS_TEST)["rule_files"] == [ALERTS.name]


def test_the_required_alerts_exist() -> None:
    by_name = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    assert "torchtelemetry_last_update_timestamp_seconds" in by_name["TrainingStalled"]
    assert "torchtelemetry_train_step" in queried_metrics(by_name["TrainingStepNotAdvancing"])
    assert "torchtelemetry_train_loss" in queried_metrics(by_name["LossNotFinite"])
    assert "torchtelemetry_exporter_errors_total" in queried_metrics(by_name["ExportErrorsRising"])
    assert {
        "torchtelemetry_train_data_wait_share_percent",
        "torchtelemetry_train_data_wait_share_max_percent",
    } == queried_metrics(by_name["DataWaitHigh"])
    assert "torchtelemetry_train_memory_alloc_retries_total" in queried_metrics(
        by_name["AllocatorRetriesRising"]
    )
    assert "torchtelemetry_train_memory_ooms_total" in queried_metrics(by_name["CudaOutOfMemory"])


def test_no_alert_watches_step_time_across_ranks() -> None:
    """In synchronous training every rank's step time is the slowest rank's: a straggler alert on
    it cannot fire (docs/stack.md), so there is none until a measure that differs between ranks."""
    names = {rule["alert"] for rule in alert_rules()}
    assert "RankStraggler" not in names
    for rule in alert_rules():
        assert not {m for m in queried_metrics(rule["expr"]) if "step_time" in m}, rule["alert"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alerts_query_only_what_the_library_emits(rule: dict) -> None:
    metrics = queried_metrics(rule["expr"])
    assert metrics, f"{rule['alert']} queries no torchtelemetry metric"
    assert metrics <= emitted_names(), f"{rule['alert']}: not emitted: {sorted(metrics - emitted_names())}"
    labels = queried_labels(rule["expr"])
    assert labels <= emitted_labels(), (
        f"{rule['alert']}: labels never set: {sorted(labels - emitted_labels())}"
    )
    for field in ("severity",):
        assert rule["labels"][field] in ("warning", "critical")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_scrape_jobs_cover_every_route() -> None:
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]}
    assert jobs["pushgateway"]["honor_labels"] is True, "pushed job/run labels must survive the scrape"
    assert jobs["otel-collector"]["honor_labels"] is True
    assert {"pushgateway", "otel-collector", "torchtelemetry"} <= set(jobs)
    assert load_yaml(PROMETHEUS_CONFIG)["rule_files"] == [ALERTS.name]
