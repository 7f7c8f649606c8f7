"""What a run prints on its exporting rank: one line at start-up saying where the reports go, a short
line per window (opt-out: `window_lines=False`), none beside a `ConsoleExporter`; on stderr, so that
Python's default logging configuration (WARNING and above) hides neither."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.export import RunInfo, startup_line, window_line
from torchtelemetry.report import HistogramValue


def _train(telemetry: tt.Telemetry, steps: int, loss: float = 2.0) -> None:
    for step in range(steps):
        telemetry.metrics["train"]["loss"].update(torch.tensor(loss), 1)
        telemetry.step(step, tokens=1000, samples=4)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("torchtelemetry:")]


def test_one_line_at_start_up_and_a_short_line_per_window(tmp_path: Path, capfd) -> None:
    path = tmp_path / "m.jsonl"
    prometheus = tt.PrometheusExporter(port=0, linger_s=0)
    metrics = {"train": {"loss": tt.WeightedMeanMetric(), "accuracy": tt.AccuracyMetric()}}
    with tt.Telemetry(metrics, [tt.JsonlExporter(path), prometheus], every=2, run_id="lines") as telemetry:
        url = prometheus.url
        _train(telemetry, 5)
    out, err = capfd.readouterr()
    assert not _lines(out), "nothing on stdout"
    start, *windows = _lines(err)
    assert start == (
        f"torchtelemetry: run lines (1 rank), a report every 2 steps to jsonl {path}, prometheus {url}"
    )
    reports = [json.loads(line) for line in path.read_text().splitlines()]
    assert [int(line.split()[2]) for line in windows] == [report["step"] for report in reports] == [1, 3, 4]
    for line, report in zip(windows, reports, strict=True):
        rate = report["values"]["train/tokens_per_second"]
        assert line.startswith(f"torchtelemetry: step {report['step']} | train/loss 2 | ")
        assert line.endswith(" tokens/s | ok") and "accuracy" not in line, line
        shown = line.split(" | ")[2].removesuffix(" tokens/s")
        scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(shown[-1], 1.0)
        assert float(shown.rstrip("kMG")) * scale == pytest.approx(rate, rel=5e-3), (shown, rate)
        assert len(line) < 80, line


def test_window_lines_off_leaves_the_start_up_line(capfd) -> None:
    with tt.Telemetry({"train": {"loss": tt.WeightedMeanMetric()}}, every=1, window_lines=False) as telemetry:
        _train(telemetry, 3)
    (start,) = _lines(capfd.readouterr().err)
    assert start.endswith("a report every 1 steps to no exporter (Telemetry.latest only)")


def test_a_console_exporter_keeps_its_full_line_and_no_short_line_is_added(capfd) -> None:
    with tt.Telemetry({"train": {"loss": tt.WeightedMeanMetric()}}, [tt.ConsoleExporter()], every=2) as t:
        _train(t, 4)
    err = capfd.readouterr().err
    (start,) = _lines(err)
    assert start.endswith("to console stderr")
    full = [line for line in err.splitlines() if " step " in line and not line.startswith("torchtelemetry:")]
    assert len(full) == 2 and all("train/step_time{rank}" not in line for line in full)
    assert all("train/loss=2" in line and "train/tokens=" in line for line in full), full


def test_a_window_with_non_finite_values_says_so(tmp_path: Path, capfd) -> None:
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    with tt.Telemetry(metrics, every=2, dump_dir=tmp_path, window_lines=True) as telemetry:
        _train(telemetry, 2)
        _train(telemetry, 2, loss=math.nan)
    first, second = _lines(capfd.readouterr().err)[1:]
    assert first.endswith("| ok") and second.endswith("| non-finite values"), (first, second)


def test_the_health_word_names_what_the_window_found() -> None:
    window = {"train/nonfinite/count": {"train/loss": 0.0}, "train/spike/count": {"train/loss": 1.0}}
    values = {**window, "train/straggler/top_rank": {"1": 3.0, "2": 5.0}}
    assert window_line(9, values, window) == "torchtelemetry: step 9 | spike, straggler rank 3"
    histogram = HistogramValue((1.0,), (1.0, 0.0), 0.5, 1.0)
    line = window_line(
        7, {"val/nll_loss": 1.25, "train/grad_norm": histogram, "train/samples_per_second": 12.0}, {}
    )
    assert line == "torchtelemetry: step 7 | val/nll_loss 1.25 | 12 samples/s | ok"


def test_both_lines_show_under_python_s_default_logging_configuration(tmp_path: Path) -> None:
    """No `logging` set up at all: a line logged at INFO (where the scrape endpoint's URL used to be
    said only) would not show."""
    script = (
        "import torch, torchtelemetry as tt\n"
        "metrics = {'train': {'loss': tt.WeightedMeanMetric()}}\n"
        "with tt.Telemetry(metrics, [tt.PrometheusExporter(port=0, linger_s=0)], every=2) as telemetry:\n"
        "    for step in range(2):\n"
        "        metrics['train']['loss'].update(torch.tensor(1.5), 1)\n"
        "        telemetry.step(step)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    start, window = _lines(done.stderr)
    assert "to prometheus http://127.0.0.1:" in start and start.endswith("/metrics")
    assert window == "torchtelemetry: step 1 | train/loss 1.5 | ok"


def test_the_start_up_line_names_each_destination_with_its_secrets_masked(tmp_path: Path) -> None:
    exporters = [
        tt.PushgatewayExporter("http://user:secret@127.0.0.1:9091"),
        tt.OTelExporter(endpoint="http://127.0.0.1:4318"),
        tt.JsonlExporter(tmp_path / "m.jsonl"),
    ]
    line = startup_line(RunInfo(run_id="r", world_size=4), 10, exporters)
    assert line == (
        "torchtelemetry: run r (4 ranks), a report every 10 steps to pushgateway "
        f"http://127.0.0.1:9091, otlp http://127.0.0.1:4318, jsonl {tmp_path / 'm.jsonl'}"
    )
    mlflow = tt.MLflowExporter("https://user:secret@mlflow.example/?token=secret")
    assert startup_line(RunInfo(run_id="r"), 1, [mlflow]).endswith(
        "mlflow https://***@mlflow.example/?token=***"
    )
