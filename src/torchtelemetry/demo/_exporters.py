"""The exporters the demo's flags turn on."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchtelemetry.demo._config import DEFAULT_PUSHGATEWAY, DemoConfig
from torchtelemetry.demo._console import ProgressSafeStream

__all__ = ["build_exporters"]


def build_exporters(config: DemoConfig, run_id: str) -> list[Any]:
    """Console, Prometheus, Pushgateway, OTLP, W&B, TensorBoard, MLflow and JSONL, as `config` asks:
    each exporter field None is off, "" on at the exporter's default destination."""
    from torchtelemetry import export

    exporters: list[Any] = []
    if config.console:
        exporters.append(export.ConsoleExporter(stream=ProgressSafeStream()))
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
            export.TensorBoardExporter(config.tensorboard or Path("runs") / run_id / "tensorboard")
        )
    if config.mlflow is not None:
        exporters.append(export.MLflowExporter(config.mlflow or None, experiment_name="torchtelemetry-demo"))
    if config.jsonl is not None:
        exporters.append(export.JsonlExporter(config.jsonl or Path("runs") / run_id / "metrics.jsonl"))
    return exporters
