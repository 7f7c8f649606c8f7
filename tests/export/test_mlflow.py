"""MLflowExporter against a real SQLite tracking store, read back with `MlflowClient`."""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import free_port, run_ranks
from tests.export.trackers import CONFIG, NO_HISTOGRAM, TIMESTAMPS, export_label_clashes, tracker_rank
from tests.export.workload import STEPS, expected_values
from torchtelemetry.export import ExportResult, MetricDescriptor, MLflowExporter, RunInfo

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

LOSS = MetricDescriptor("train/loss")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite tracking store for the module (creating one runs MLflow's migrations: seconds)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    mlflow.MlflowClient(tracking_uri=uri).search_experiments()
    return uri


@pytest.fixture(autouse=True)
def clean_mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(key, raising=False)


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp in ms) of every logged value of `key`, by step."""
    metrics = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return sorted((m.step, m.value, m.timestamp) for m in metrics)


def only_run(uri: str, experiment: str):
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def test_two_ranks_one_run_with_every_step_value_and_timestamp(store: str) -> None:
    options = {"tracking_uri": store, "experiment_name": "two-ranks", "tags": {"team": "ci"}}
    results = run_ranks(tracker_rank, 2, "MLflowExporter", options, "mlflow-two-ranks", timeout_s=180)
    assert results == [{"reports": len(STEPS), "errors": 0}, {}]

    run = only_run(store, "two-ranks")  # rank 1 made no run
    assert (run.info.run_name, run.info.status) == ("mlflow-two-ranks", "FINISHED")
    assert run.data.tags["torchtelemetry.run_id"] == "mlflow-two-ranks"
    assert (run.data.tags["torchtelemetry.world_size"], run.data.tags["team"]) == ("2", "ci")
    assert {key: json.loads(value) for key, value in run.data.params.items()} == CONFIG

    run_id = run.info.run_id
    expected = [expected_values(2, window + 1) for window in range(len(STEPS))]
    millis = [int(timestamp * 1000) for timestamp in TIMESTAMPS]

    def logged(key: str, values: list[float]) -> None:
        assert history(store, run_id, key) == list(zip(STEPS, values, millis, strict=True)), key

    logged("train/loss", [values["train/loss"] for values in expected])
    logged("tokens", [values["tokens"] for values in expected])  # counters: running totals
    logged("step_time/rank_0", [0.25] * 3)
    logged("step_time/rank_1", [0.5] * 3)
    logged("exporter/exported_reports/exporter_mlflow", [1.0, 2.0, 3.0])
    # histograms: each interval's count, sum and mean
    totals = [NO_HISTOGRAM] + [values["grad_norm"] for values in expected]
    counts = [float(now["count"] - then["count"]) for then, now in itertools.pairwise(totals)]
    sums = [now["sum"] - then["sum"] for then, now in itertools.pairwise(totals)]
    logged("grad_norm/count", counts)
    assert [value for _, value, _ in history(store, run_id, "grad_norm/sum")] == pytest.approx(sums)
    means = [value for _, value, _ in history(store, run_id, "grad_norm/mean")]
    assert means == pytest.approx([s / c for s, c in zip(sums, counts, strict=True)])


def test_a_restarted_job_resumes_its_run_and_adds_only_new_params(store: str) -> None:
    for steps, config in (([1, 2], {"lr": 0.5}), ([3, 4], {"lr": 0.5, "resumed_from": 2})):
        exporter = MLflowExporter(store, experiment_name="resume")
        exporter.describe([LOSS], RunInfo(run_id="restarted", config=config))
        for step in steps:
            assert exporter.export(step, {"train/loss": float(step)}, 10.0 + step) is ExportResult.SUCCESS
        exporter.close()
    run = only_run(store, "resume")
    assert run.info.run_id == exporter.run_id
    assert run.data.params == {"lr": "0.5", "resumed_from": "2"}
    assert [step for step, _, _ in history(store, run.info.run_id, "train/loss")] == [1, 2, 3, 4]


def test_a_new_local_store_drops_no_report_while_mlflow_creates_it(tmp_path: Path) -> None:
    """A fresh SQLite store takes MLflow's migrations (seconds): made as the exporter starts, not by
    the first export while the loop runs on and the queue overflows (reports were dropped)."""
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    exporter = tt.MLflowExporter(uri, experiment_name="fresh")
    telemetry = tt.Telemetry(metrics, [exporter], every=1, queue_size=8, run_id="fresh", signals=False)
    assert exporter.run_id is not None, "the store and the run exist once the Telemetry is built"
    for step in range(12):  # 12 reports in 0.6 s: more than the queue holds while a store is created
        metrics["train"]["loss"].update(torch.tensor([float(step)]))
        telemetry.step(step)
        time.sleep(0.05)  # the step's work
    telemetry.close()
    health = telemetry.hub.health()["mlflow"]
    assert (health.exported_reports, health.dropped_reports, health.errors) == (12, 0, 0)
    assert [step for step, _, _ in history(uri, exporter.run_id, "train/loss")] == list(range(12))


def test_a_local_store_that_cannot_open_yet_is_retried_by_each_export(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "later"
    blocker.write_text("a file where the store's directory should be: the store cannot open yet")
    database = blocker / "mlflow.db"
    exporter = MLflowExporter(f"sqlite:///{database}", experiment_name="late")
    with caplog.at_level(logging.ERROR):
        exporter.describe([LOSS], RunInfo(run_id="late"))  # starts: tries the local store, logs
        assert "cannot start an MLflow run" in caplog.text and "each export tries again" in caplog.text
        assert exporter.run_id is None
        assert exporter.export(1, {"train/loss": 1.0}, 1.0) is ExportResult.FAILURE  # the exporter's thread
    assert not exporter.force_flush()
    blocker.unlink()  # the store can open now: the next export makes the run
    assert exporter.export(2, {"train/loss": 2.0}, 2.0) is ExportResult.SUCCESS
    exporter.close()
    assert history(f"sqlite:///{database}", exporter.run_id, "train/loss") == [(2, 2.0, 2000)]


def test_an_unreachable_server_counts_failures_and_training_goes_on(monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retry setting
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    exporter = tt.MLflowExporter(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    telemetry = tt.Telemetry(metrics, [exporter], every=1, run_id="mlflow-dead")
    for step in range(5):
        metrics["train"]["loss"].update(torch.tensor([1.0]))
        telemetry.step(step)
    telemetry.close()
    health = telemetry.hub.health()["mlflow"]
    assert health.exported_reports == 0
    assert health.errors + health.dropped_reports == 5  # every report accounted for
    assert exporter.run_id is None


def test_tracking_uri_argument_beats_environment_which_beats_the_default(store: str, monkeypatch) -> None:
    assert MLflowExporter().tracking_uri == mlflow.get_tracking_uri()  # MLflow's default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    from_env = MLflowExporter()  # constructible with no argument
    assert (from_env.tracking_uri, from_env.experiment_name) == (store, "from-env")
    from_env.describe([LOSS], RunInfo(run_id="env"))
    assert from_env.export(1, {"train/loss": 1.0}, 1.0) is ExportResult.SUCCESS
    from_env.close()
    assert only_run(store, "from-env").info.run_name == "env"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # dead
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    argument = MLflowExporter(store, run_name="named")
    argument.describe([LOSS], RunInfo(run_id="arg"))
    assert argument.export(1, {"train/loss": 1.0}, 1.0) is ExportResult.SUCCESS
    argument.close()
    assert only_run(store, "Default").info.run_name == "named"  # MLflow's default experiment


def test_reports_over_mlflow_s_batch_limit_are_logged_whole(store: str) -> None:
    exporter = MLflowExporter(store, experiment_name="wide")
    wide = MetricDescriptor("wide", label_name="unit")
    exporter.describe([wide], RunInfo(run_id="wide"))
    values = {str(index): float(index) for index in range(1500)}
    assert exporter.export(1, {"wide": values}, 1.0) is ExportResult.SUCCESS
    exporter.close()
    logged = mlflow.MlflowClient(tracking_uri=store).get_run(exporter.run_id).data.metrics
    assert len(logged) == 1500 and logged["wide/unit_1499"] == 1499.0


def test_a_histogram_s_keys_clashing_with_metrics_fail_when_telemetry_is_built(store: str) -> None:
    metrics = {
        "grad": tt.HistogramMetric(bins=[1.0]),
        "grad/count": tt.SumMetric(),
        "grad/sum": tt.SumMetric(),
    }
    exporter = MLflowExporter(store, experiment_name="histogram-clash")
    with pytest.raises(tt.report.NameCollisionError) as raised:
        tt.Telemetry(metrics, [exporter], signals=False)
    message = str(raised.value)
    assert "['grad', 'grad/count'] -> 'grad/count'" in message
    assert "['grad', 'grad/sum'] -> 'grad/sum'" in message
    assert mlflow.MlflowClient(tracking_uri=store).get_experiment_by_name("histogram-clash") is None
    exporter.close()


def test_label_values_sanitized_into_one_key_are_left_out_counted_and_logged(store: str, caplog) -> None:
    exporter = MLflowExporter(store, experiment_name="label-clash")
    export_label_clashes(exporter, caplog)
    run_id = exporter.run_id
    assert history(store, run_id, "queue/host_a_b") == [(1, 1.0, 1000), (3, 3.0, 3000)]  # only 'a/b'
    assert history(store, run_id, "step_time/rank_0") == [(1, 0.75, 1000)]  # only the metric
    assert history(store, run_id, "step_time/rank_1") == [(1, 0.25, 1000)]
    assert history(store, run_id, "train/loss") == [(1, 0.5, 1000), (2, 0.25, 2000)]  # the rest is logged


def test_close_twice_warns_and_export_after_close_fails(store: str) -> None:
    exporter = MLflowExporter(store, experiment_name="twice")
    exporter.describe([LOSS], RunInfo(run_id="twice"))
    exporter.close()
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()
    assert exporter.export(1, {"train/loss": 1.0}, 0.0) is ExportResult.FAILURE


def test_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"torchtelemetry\[mlflow\]"):
        MLflowExporter()
