"""Prometheus config and alert rules: promtool accepts them, they fire when they should, names are real."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("yaml")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

import yaml

from tests.servers import PrometheusServer, binary, http_get
from tests.stack._stack import (
    ALERTS,
    ALERTS_TEST,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DIR,
    PROMETHEUS_HOST_CONFIG,
    RECORDED_LABELS,
    STACK_DOC,
    alert_rules,
    emitted_labels,
    emitted_names,
    load_yaml,
    queried_labels,
    queried_metrics,
    recording_rules,
    rules,
)
from torchtelemetry import PrometheusExporter, Telemetry, WeightedMeanMetric

PROMTOOL = shutil.which("promtool")
FINISHED = "torchtelemetry_run_finished_timestamp_seconds"
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


def _documented_additions() -> dict:
    """The `rule_files` and `scrape_configs` entries docs/stack.md tells a Prometheus owner to add."""
    section = STACK_DOC.read_text().split("## Prometheus outside Docker", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    return yaml.safe_load(snippet)


def test_the_documented_jobs_are_the_shipped_host_config() -> None:
    added = _documented_additions()
    host = load_yaml(PROMETHEUS_HOST_CONFIG)
    own = [job for job in host["scrape_configs"] if job["job_name"] != "prometheus"]
    assert sorted(added["scrape_configs"], key=str) == sorted(own, key=str)
    assert (
        "cp exporters/prometheus/prometheus-host.yml /etc/prometheus/prometheus.yml"
        not in STACK_DOC.read_text()
    )


@pytest.mark.skipif(binary("prometheus") is None, reason="prometheus not installed")
def test_an_existing_prometheus_with_the_documented_additions_scrapes_the_trainer(tmp_path) -> None:
    """A Prometheus owner's config keeps its own job and rules and gains the trainer's routes and alerts."""
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"train": {"loss": WeightedMeanMetric()}}, [exporter], every=1, run_id="host")
    telemetry.step(0)
    telemetry.flush()
    own_rules = {"groups": [{"name": "mine", "rules": [{"record": "mine:up", "expr": "up"}]}]}
    (tmp_path / "mine.yml").write_text(yaml.safe_dump(own_rules))
    existing = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["mine.yml"],
        "scrape_configs": [{"job_name": "mine", "static_configs": [{"targets": ["127.0.0.1:1"]}]}],
    }
    added = yaml.safe_dump(_documented_additions()).replace("127.0.0.1:9464", f"127.0.0.1:{exporter.port}")
    additions = yaml.safe_load(added)
    config = {**existing, **{key: existing[key] + additions[key] for key in ("rule_files", "scrape_configs")}}
    (tmp_path / "torchtelemetry-alerts.yml").write_text(ALERTS.read_text())  # the documented cp
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = _promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    try:
        with _ShippedConfigPrometheus(tmp_path, yaml.safe_dump(config)) as prometheus:
            assert prometheus.wait_for('torchtelemetry_train_step{job="torchtelemetry", run="host"}')
            assert prometheus.wait_for('up{job="mine"}'), "the owner's own job is still there"
            groups = json.loads(http_get(f"{prometheus.url}/api/v1/rules"))["data"]["groups"]
            loaded = {rule["name"] for group in groups for rule in group["rules"]}
            assert loaded == {"mine:up"} | {rule.get("alert") or rule["record"] for rule in rules()}
            telemetry.close()  # while Prometheus scrapes: its next scrape reads the final report
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
    assert f"{len(rules())} rules found" in result.stdout


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
    assert "torchtelemetry:loss_sum_5m" in by_name["LossNotFinite"]
    assert "torchtelemetry_exporter_errors_total" in queried_metrics(by_name["ExportErrorsRising"])
    assert {
        "torchtelemetry_train_data_wait_share_percent",
        "torchtelemetry_train_data_wait_share_max_percent",
    } == queried_metrics(by_name["DataWaitHigh"]) - {FINISHED}
    assert "torchtelemetry_train_memory_alloc_retries_total" in queried_metrics(
        by_name["AllocatorRetriesRising"]
    )
    assert "torchtelemetry_train_memory_ooms_total" in queried_metrics(by_name["CudaOutOfMemory"])
    assert "torchtelemetry_train_nonfinite_count_total" in queried_metrics(by_name["NonFiniteValues"])
    assert "torchtelemetry_train_spike_count_total" in queried_metrics(by_name["LossSpike"])
    assert "torchtelemetry_train_memory_headroom_min_bytes" in queried_metrics(by_name["MemoryHeadroomLow"])
    assert "torchtelemetry_train_goodput_ratio" in queried_metrics(by_name["GoodputLow"])
    assert "torchtelemetry_hw_gpu_throttled_max" in queried_metrics(by_name["GpuThrottled"])


def test_no_alert_watches_step_time_across_ranks() -> None:
    """In synchronous training every rank's step time is the slowest rank's: a straggler alert on
    it cannot fire (docs/stack.md); RankStraggler reads the phases' straggler scores instead."""
    by_name = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    assert "torchtelemetry_train_straggler_score" in queried_metrics(by_name["RankStraggler"])
    for rule in alert_rules():
        assert not {m for m in queried_metrics(rule["expr"]) if "step_time" in m}, rule["alert"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_leaves_finished_runs_alone_and_fires_once_per_run(rule: dict) -> None:
    expr = " ".join(rule["expr"].split())
    assert expr.endswith(f"unless on (job, run) {FINISHED}"), f"{rule['alert']}: {expr}"
    assert re.search(r"^(time\(\) - )?\(?\s*(max|min|count) by \(job, run\b", expr), (
        f"{rule['alert']} must aggregate the routes' copies of a run by (job, run, ...): {expr}"
    )


@needs_promtool
def test_the_finished_twins_in_the_rule_tests_fire_without_their_marker(tmp_path: Path) -> None:
    """Every alert's unit tests hold a run whose telemetry was closed (the run-finished marker) and
    that stays quiet; without its marker, the same run fires: the marker is what keeps it quiet."""
    tests = load_yaml(ALERTS_TEST)
    finished_runs = set()
    for case in tests["tests"]:
        kept = []
        for series in case["input_series"]:
            if series["series"].startswith(FINISHED):
                finished_runs.add(re.search(r'run="([^"]+)"', series["series"]).group(1))
            else:
                kept.append(series)
        case["input_series"] = kept
    (tmp_path / ALERTS.name).write_text(ALERTS.read_text())
    (tmp_path / "unfinished_test.yml").write_text(json.dumps(tests))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "unfinished_test.yml"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0, "without their markers the finished runs must fire"
    runs = "|".join(map(re.escape, finished_runs))
    for rule in alert_rules():
        assert re.search(
            rf'alertname="{rule["alert"]}"[^}}]*run="(?:{runs})"', result.stdout + result.stderr
        ), f"{rule['alert']}: no finished run in its tests would fire without the marker"


def test_loss_not_finite_watches_every_loss_and_the_hugging_face_trainers() -> None:
    (expr,) = recording_rules().values()
    (pattern,) = re.findall(r'__name__=~"([^"]+)"', expr)
    watched = ["torchtelemetry_train_loss", "torchtelemetry_val_loss", "torchtelemetry_hf_loss"]
    watched += ["torchtelemetry_lightning_train_loss", "torchtelemetry_loss"]
    assert all(re.fullmatch(pattern, name) for name in watched)
    ignored = ["torchtelemetry_train_loss_total", "torchtelemetry_train_loss_bucket", "torchtelemetry_lossy"]
    assert not any(re.fullmatch(pattern, name) for name in ignored)


@needs_promtool
def test_the_documented_rule_points_loss_not_finite_at_a_loss_of_another_name(tmp_path: Path) -> None:
    """docs/stack.md's rule file, as printed, makes LossNotFinite watch `train/nll`."""
    (snippet,) = re.findall(r"```yaml\n(# my-losses.yml\n.*?)```", STACK_DOC.read_text(), re.DOTALL)
    (tmp_path / "my-losses.yml").write_text(snippet)
    (tmp_path / ALERTS.name).write_text(ALERTS.read_text())
    alert = {
        "severity": "critical",
        "job": "trainer",
        "run": "nll",
        "metric": "torchtelemetry_train_nll",
    }
    annotations = {
        "summary": "Run nll: torchtelemetry_train_nll is NaN or infinite",
        "description": (
            "torchtelemetry_train_nll of run nll (job trainer) was not finite in the last 5 minutes."
        ),
    }
    test = {
        "rule_files": [ALERTS.name, "my-losses.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'torchtelemetry_train_nll{job="trainer", run="nll"}',
                        "values": "2.5 2.4 NaN NaN",
                    },
                    {
                        "series": 'torchtelemetry_train_nll{job="trainer", run="ok"}',
                        "values": "2.5 2.4 2.3 2.2",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "LossNotFinite", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "LossNotFinite",
                        "exp_alerts": [
                            {
                                "exp_labels": alert,
                                "exp_annotations": annotations,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(json.dumps(test))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alerts_query_only_what_the_library_emits(rule: dict) -> None:
    metrics = queried_metrics(rule["expr"])
    assert metrics, f"{rule['alert']} queries no torchtelemetry metric"
    assert metrics <= emitted_names(), f"{rule['alert']}: not emitted: {sorted(metrics - emitted_names())}"
    labels = queried_labels(rule["expr"])
    assert labels <= emitted_labels() | RECORDED_LABELS, (
        f"{rule['alert']}: labels never set: {sorted(labels - emitted_labels() - RECORDED_LABELS)}"
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
