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


def assert_delivered(steps: list[int], namespace: dict[str, Any], exporter: str) -> None:
    """Every report is logged or counted as dropped, the last one always logged.

    The loop does no work between steps, so reports can outrun a tracker that is still starting
    (W&B's run, MLflow's store); the hub then drops the oldest queued ones and counts them.
    """
    health = namespace["telemetry"].hub.health()[exporter]
    assert set(steps) <= set(REPORTED_STEPS) and steps == sorted(steps) and steps[-1] == 99
    assert (health.exported_reports, health.dropped_reports, health.errors) == (
        len(steps),
        len(REPORTED_STEPS) - len(steps),
        0,
    )


def test_wandb_example(wandb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    namespace = run_example("WandbExporter", wandb_dir, monkeypatch)
    (log,) = wait_for_wandb_logs(wandb_dir, 1)
    assert (log.project, log.config["lr"]) == ("torchtelemetry-example", 3e-4)
    assert_delivered(log.steps, namespace, "wandb")
    assert log.history[-1]["train/loss"] == pytest.approx(sum(1 / (s + 1) for s in range(90, 100)) / 10)


def test_tensorboard_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    namespace = run_example("TensorBoardExporter", tmp_path, monkeypatch)
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "runs" / "example"), size_guidance={"histograms": 0}
    )
    events.Reload()
    steps = [event.step for event in events.Scalars("train/loss")]
    assert_delivered(steps, namespace, "tensorboard")
    # delta histograms: a dropped report's window is folded into the next, so all 100 x 4 values arrive,
    # between the bounds or in the open outer buckets' scalars
    counts = [sum(h.histogram_value.bucket) for h in events.Histograms("train/grad_norm")]
    outer = [e.value for key in ("underflow", "overflow") for e in events.Scalars(f"train/grad_norm/{key}")]
    assert len(counts) == len(steps) and sum(counts) + sum(outer) == 400.0


def test_mlflow_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    namespace = run_example("MLflowExporter", tmp_path, monkeypatch)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("torchtelemetry-example").experiment_id])
    assert run.data.params == {"lr": "0.0003"}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    # on a loaded machine the reports can outrun MLflow's store while it starts: dropped, counted
    assert_delivered(sorted(metric.step for metric in history), namespace, "mlflow")
