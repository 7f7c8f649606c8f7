"""TelemetryMetricLogger: torchtitan's `log(metrics, step)` / `close()` protocol feeding the exporters."""

from __future__ import annotations

import json
import logging

import torch

from torchtelemetry import JsonlExporter, WeightedMeanMetric
from torchtelemetry.integrations import TelemetryMetricLogger
from torchtelemetry.telemetry import Telemetry


def test_logged_values_are_exported_in_step_order_with_the_collections(tmp_path, caplog) -> None:
    path = tmp_path / "telemetry.jsonl"
    loss = WeightedMeanMetric()
    telemetry = Telemetry({"train/loss": loss}, [JsonlExporter(path)], every=2, signals=False)
    metric_logger = TelemetryMetricLogger(telemetry, prefix="titan/")

    loss.update(torch.tensor(1.0))
    telemetry.step(1)
    with caplog.at_level(logging.WARNING):
        metric_logger.log(
            {
                "loss_metrics/global_avg_loss": 1.5,
                "ntokens_seen": 128,
                "grad_norm": torch.tensor(0.25),
                "memory/max_active(GiB)": 1.25,
                "mfu(%)": 41.5,
                "tag": "not a number",
                "step_time": {"0": 0.5, "1": 0.75},
            },
            step=1,
        )
    loss.update(torch.tensor(3.0))
    telemetry.step(2)  # schedules a collection; it stays in flight until the next step or close
    metric_logger.log({"loss_metrics/global_avg_loss": 2.5}, step=2)
    metric_logger.log({"validation_metrics/loss": 4.0}, step=3)
    telemetry.close()

    with open(path, encoding="utf-8") as file:
        reports = [(record["step"], record["values"]) for record in map(json.loads, file)]
    health = {name for _, values in reports for name in values if name.startswith("exporter/")}
    reports = [(step, {k: v for k, v in values.items() if k not in health}) for step, values in reports]
    assert reports == [
        (
            1,
            {
                "titan/loss_metrics/global_avg_loss": 1.5,
                "titan/ntokens_seen": 128.0,
                "titan/grad_norm": 0.25,
                "titan/step_time": {"0": 0.5, "1": 0.75},
                "titan/memory/max_active_GiB": 1.25,
                "titan/mfu_pct": 41.5,
            },
        ),
        (2, {"train/loss": 2.0, "titan/loss_metrics/global_avg_loss": 2.5}),
        (3, {"titan/validation_metrics/loss": 4.0}),
    ]
    skipped = [record.getMessage() for record in caplog.records]
    assert any("'titan/tag' skipped: str values are not exported" in message for message in skipped)


def test_close_flushes_without_closing_the_telemetry(tmp_path) -> None:
    path = tmp_path / "telemetry.jsonl"
    telemetry = Telemetry({}, [JsonlExporter(path)], signals=False)
    metric_logger = TelemetryMetricLogger(telemetry)
    metric_logger.log({"loss": 1.0}, step=7)
    metric_logger.close()

    with open(path, encoding="utf-8") as file:
        assert json.loads(file.readline())["values"]["loss"] == 1.0
    metric_logger.log({"loss": 0.5}, step=8)  # the loop, not the logger, closes the Telemetry
    telemetry.close()
    with open(path, encoding="utf-8") as file:
        assert [json.loads(line)["step"] for line in file] == [7, 8]


def test_telemetry_log_and_the_logger_name_free_form_keys_by_one_rule(tmp_path, caplog) -> None:
    path = tmp_path / "telemetry.jsonl"
    telemetry = Telemetry({}, [JsonlExporter(path)], signals=False)
    with caplog.at_level(logging.WARNING):
        telemetry.log({"my loss": 1.0, "mfu(%)": 40.0, "()": 3.0}, step=1)
        TelemetryMetricLogger(telemetry).log({"my loss": 2.0, "mfu(%)": 41.0}, step=2)
    telemetry.close()

    with open(path, encoding="utf-8") as file:
        reports = [
            (record["step"], {k: v for k, v in record["values"].items() if not k.startswith("exporter/")})
            for record in map(json.loads, file)
        ]
    assert reports == [(1, {"my_loss": 1.0, "mfu_pct": 40.0}), (2, {"my_loss": 2.0, "mfu_pct": 41.0})]
    assert "'()' skipped" in caplog.text, "a name with nothing legal left is named in a warning"
