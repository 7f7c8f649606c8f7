"""The README's experiment-tracker examples, run as written and read back from what each tracker wrote."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.export.test_wandb import wandb_dir  # noqa: F401 (fixture: offline W&B in a temporary directory)
from tests.receivers import wait_for_wandb_logs

README = Path(__file__).parents[2] / "README.md"
REPORTED_STEPS = list(range(9, 100, 10))  # every=10 over steps 0..99


def example(tracker: str) -> str:
    """The README example whose code builds `tt.<tracker>`."""
    section = README.read_text().split("### Experiment trackers", 1)[1].split("\n## ", 1)[0]
    (code,) = [
        code for code in re.findall(r"```python\n(.*?)```", section, re.DOTALL) if f"tt.{tracker}(" in code
    ]
    return code


def run_example(tracker: str, where: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run the example in `where`; its globals (`telemetry`, `exporter`)."""
    monkeypatch.chdir(where)
    namespace: dict[str, Any] = {}
    exec(compile(example(tracker), f"README.md ({tracker})", "exec"), namespace)
    return namespace


def test_wandb_example(wandb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    run_example("WandbExporter", wandb_dir, monkeypatch)
    (log,) = wait_for_wandb_logs(wandb_dir, 1)
    assert (log.project, log.config["lr"], log.steps) == ("torchtelemetry-example", 3e-4, REPORTED_STEPS)
    assert log.history[-1]["train/loss"] == pytest.approx(sum(1 / (s + 1) for s in range(90, 100)) / 10)


def test_tensorboard_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_example("TensorBoardExporter", tmp_path, monkeypatch)
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "runs" / "example"), size_guidance={"histograms": 0}
    )
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == REPORTED_STEPS
    assert [sum(h.histogram_value.bucket) for h in events.Histograms("train/grad_norm")] == [40.0] * 10


def test_mlflow_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    health = run_example("MLflowExporter", tmp_path, monkeypatch)["telemetry"].hub.health()["mlflow"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("torchtelemetry-example").experiment_id])
    assert run.data.params == {"lr": "0.0003"}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    logged = sorted(metric.step for metric in history)
    # the first export creates the SQLite store (MLflow's migrations: seconds); this loop does not
    # wait for it, so reports queued meanwhile may be dropped, counted, never training slowed
    assert set(logged) <= set(REPORTED_STEPS) and logged[-1] == 99
    assert (health.exported_reports, health.dropped_reports, health.errors) == (
        len(logged),
        10 - len(logged),
        0,
    )
