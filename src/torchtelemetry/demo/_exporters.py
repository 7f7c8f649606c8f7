"""The exporters the demo's flags turn on."""

from __future__ import annotations

import os
from typing import Any

from torchtelemetry.demo._config import DEFAULT_PUSHGATEWAY, DemoConfig, run_directory

__all__ = ["build_exporters"]


def build_exporters(config: DemoConfig, run_id: str) -> list[Any]:
    """Prometheus, Pushgateway, OTLP, W&B, TensorBoard, MLflow and JSONL, as `config` asks: each
    exporter field None is off, "" on at the exporter's default destination (the console's short line
    per window is `Telemetry`'s own: `TelemetryConfig.window_lines`)."""
    from torchtelemetry import export

    exporters: list[Any] = []
    if config.prometheus_port is not None:
        exporters.append(export.PrometheusExporter(port=config.prometheus_port))
    if config.pushgateway is not None:
        exporters.append(export.PushgatewayExporter(config.pushgateway or DEFAULT_PUSHGATEWAY))
    if config.otlp is not None:
        if config.otlp:
            # The generic endpoint: OTelExporter appends /v1/metrics for OTLP/HTTP (never twice).
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = config.otlp
        exporters.append(export.OTelExporter())
    if config.wandb is not None:
        exporters.append(
            export.WandbExporter(
                project="torchtelemetry-demo", mode=config.wandb or None, summaries={"train/loss": "min"}
            )
        )
    if config.tensorboard is not None:
        exporters.append(
            export.TensorBoardExporter(config.tensorboard or run_directory(run_id) / "tensorboard")
        )
    if config.mlflow is not None:
        exporters.append(export.MLflowExporter(config.mlflow or None, experiment_name="torchtelemetry-demo"))
    if config.jsonl is not None:
        exporters.append(export.JsonlExporter(config.jsonl or run_directory(run_id) / "metrics.jsonl"))
    return exporters
