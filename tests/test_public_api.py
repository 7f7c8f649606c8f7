"""The public surface: pinned names, documented, and an import that needs only torch."""

from __future__ import annotations

import inspect
import subprocess
import sys

import torchtelemetry as tt

PUBLIC = [
    "AccuracyMetric",
    "AsyncMetricCollector",
    "BinaryAUROCMetric",
    "CollectionError",
    "ConfusionMatrixMetric",
    "ConsoleExporter",
    "HistogramMetric",
    "JsonlExporter",
    "MLflowExporter",
    "MaxMetric",
    "Metric",
    "MetricAccumulator",
    "MinMetric",
    "OTelExporter",
    "PerRankMetric",
    "PrometheusExporter",
    "PushgatewayExporter",
    "RunIdentity",
    "StopOnSignal",
    "SumMetric",
    "Telemetry",
    "TelemetryConfig",
    "TelemetryStartupError",
    "TensorBoardExporter",
    "WandbExporter",
    "WeightedMeanMetric",
    "__version__",
    "sync_and_compute",
    "sync_metrics",
]


def test_public_names_are_pinned() -> None:
    assert tt.__all__ == PUBLIC


def test_every_public_class_and_function_is_documented() -> None:
    undocumented = [
        name
        for name in tt.__all__
        if (inspect.isclass(getattr(tt, name)) or inspect.isfunction(getattr(tt, name)))
        and not (getattr(tt, name).__doc__ or "").strip()
    ]
    assert undocumented == []


def test_import_needs_only_torch() -> None:
    optional = [
        "prometheus_client",
        "opentelemetry",
        "wandb",
        "tensorboard",
        "mlflow",
        "lightning",
        "transformers",
        "accelerate",
        "grpc",
    ]
    code = (
        "import sys, torchtelemetry, torchtelemetry.integrations\n"
        f"print([m for m in {optional!r} if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
