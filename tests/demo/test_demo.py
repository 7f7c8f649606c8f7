"""`torchtelemetry demo` end to end: real ranks, a real Prometheus, an OTLP receiver, W&B offline,
TensorBoard event files and an MLflow SQLite store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.demo._process import demo_process
from tests.distributed import free_port
from tests.receivers import OtlpHttpReceiver, metrics_by_name, wait_for_wandb_logs
from tests.servers import PrometheusServer

pytestmark = pytest.mark.timeout(300)

BATCH, SEQ, RANKS = 16, 32, 2
FLOPS_PER_TOKEN = 6 * 71_104 + 12 * 2 * 64 * SEQ
"""torchtitan's estimate for the demo's model: 6 x its 71,104 parameters outside the embeddings, plus
12 x 2 layers x width 64 x the sequence length for attention."""
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _demo_env(tmp_path: Path, tag: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        WANDB_DIR=str(tmp_path / "wandb"),
        WANDB_SILENT="true",
        WANDB_DISABLE_CODE="true",
        TORCHTELEMETRY_TEST_TAG=tag,
        PYTHONUNBUFFERED="1",
    )
    return env


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def test_demo_exports_exact_values_to_every_backend(tmp_path: Path) -> None:
    steps, every = 40, 5
    port = free_port()
    jsonl = tmp_path / "metrics.jsonl"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with PrometheusServer(tmp_path / "prometheus") as prometheus, OtlpHttpReceiver() as otlp:
        prometheus.scrape("trainer", [f"127.0.0.1:{port}"])
        args = ["--nproc", str(RANKS), "--steps", str(steps), "--every", str(every),
                "--prometheus-port", str(port), "--otlp", otlp.endpoint, "--wandb", "offline",
                "--jsonl", str(jsonl), "--no-console", "--step-delay", "0.1", "--run-id", "demo-e2e",
                "--tensorboard", str(tmp_path / "tb"), "--mlflow", mlflow_uri]  # fmt: skip
        with demo_process(args, tmp_path, _demo_env(tmp_path)) as demo:
            scraped = prometheus.wait_for("torchtelemetry_train_step >= 9", timeout_s=180)
            at = time.time()
            step_samples = prometheus.query("torchtelemetry_train_step", at=at)
            loss_samples = prometheus.query("torchtelemetry_train_loss", at=at)
            output, _ = demo.communicate(timeout=240)
        assert demo.returncode == 0, output
        (start,) = [line for line in output.splitlines() if line.startswith("torchtelemetry: run ")]
        assert f"otlp {otlp.metrics_endpoint}" in start, "the start-up line names every destination"
        assert f"jsonl {jsonl}" in start and f"mlflow {mlflow_uri}" in start
        assert f"wandb {tmp_path / 'wandb'}" in start
        assert not [line for line in output.splitlines() if line.startswith("torchtelemetry: step ")]

        sent = _read_jsonl(jsonl)
        windows = list(range(every - 1, steps, every))
        # close() may send the last report once more, amended with what it learned after its window
        # (the goodput of a later checkpoint, a capture its verdicts triggered): the same step again
        assert [line["step"] for line in sent] in (windows, [*windows, windows[-1]])
        lines = list({line["step"]: line for line in sent}.values())
        for line in lines:
            values = line["values"]
            assert values["train/tokens"] == (line["step"] + 1) * BATCH * SEQ * RANKS
            assert values["train/samples"] == (line["step"] + 1) * BATCH * RANKS
            # histograms are running totals, like counters: one gradient norm per step per rank
            assert values["train/grad_norm"]["count"] == (line["step"] + 1) * RANKS
            assert sum(values["train/grad_norm"]["counts"]) == (line["step"] + 1) * RANKS
            assert set(values["train/step_time"]) == {"0", "1"}
            # every panel a CPU can fill has data: data wait (each rank's batch) and model TFLOP/s
            assert set(values["train/data_wait"]) == set(values["train/data_wait_share"]) == {"0", "1"}
            assert set(values["train/sync_wait"]) == {"0", "1"}  # the demo measures its all-reduce wait
            assert values["train/tflops_per_second"] == pytest.approx(
                FLOPS_PER_TOKEN * values["train/tokens_per_second"] / RANKS / 1e12, rel=1e-9
            )
            assert "train/mfu" not in values  # no peak FLOP/s is known for a CPU
        losses = [line["values"]["train/loss"] for line in lines]
        assert losses[-1] < losses[0] * 0.8, losses

        by_step = {line["step"]: line["values"] for line in lines}
        assert scraped[0].labels["run"] == "demo-e2e"
        scraped_step = int(step_samples[0].value)
        assert loss_samples[0].value == pytest.approx(by_step[scraped_step]["train/loss"], rel=1e-12)

        requests = otlp.wait_for_count(len(sent), timeout_s=30)
        otlp_losses = [
            metrics_by_name(r.request)["train.loss"].gauge.data_points[0].as_double for r in requests
        ]
        assert otlp_losses == pytest.approx([line["values"]["train/loss"] for line in sent], rel=1e-12)

    (wandb_run,) = wait_for_wandb_logs(tmp_path / "wandb", count=1)
    logged = {row["_step"]: row for row in wandb_run.history}
    assert sorted(logged) == sorted(by_step)
    for step, values in by_step.items():
        assert logged[step]["train/loss"] == pytest.approx(values["train/loss"], rel=1e-12)

    import mlflow

    from tests.export.test_tensorboard import read_events

    events = read_events(tmp_path / "tb")
    assert {e.step: e.value for e in events.Scalars("train/loss")} == {
        step: pytest.approx(loss, rel=1e-6) for step, loss in zip(by_step, losses, strict=True)
    }  # float32 in event files
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("torchtelemetry-demo").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    # the first export creates the SQLite store (seconds): reports queued meanwhile may be dropped
    assert steps - 1 in history
    assert history == {step: by_step[step]["train/loss"] for step in history}


def _tagged_processes(tag: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"TORCHTELEMETRY_TEST_TAG={tag}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def test_ctrl_c_flushes_the_last_window_and_leaves_no_process(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    jsonl = tmp_path / "metrics.jsonl"
    args = ["--steps", "100000", "--every", "5", "--prometheus-port", "0", "--jsonl", str(jsonl),
            "--no-console", "--step-delay", "0.02"]  # fmt: skip
    with demo_process(args, tmp_path, _demo_env(tmp_path, tag)) as demo:
        _wait(lambda: len(_read_jsonl(jsonl)) >= 2, 120, "the demo exported nothing")
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=90)
    assert demo.returncode == 130, output
    summary = [line for line in output.splitlines() if line.startswith("interrupted after step")]
    assert summary, output
    last_step = int(summary[0].split()[3].rstrip(";"))
    lines = _read_jsonl(jsonl)
    assert lines[-1]["step"] == last_step, "the last partial window was exported before exit"
    assert lines[-1]["values"]["train/samples"] == (last_step + 1) * BATCH * RANKS
    _wait(lambda: not _tagged_processes(tag), 30, f"orphan processes: {_tagged_processes(tag)}")


def test_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    result = subprocess.run(
        [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "torchtelemetry.demo",
         "--steps", "20", "--every", "5", "--prometheus-port", "0", "--jsonl", str(jsonl), "--no-console"],
        env=_demo_env(tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = _read_jsonl(jsonl)
    assert [line["step"] for line in lines] == [4, 9, 14, 19]
    assert lines[-1]["values"]["train/tokens"] == 20 * BATCH * SEQ * RANKS
