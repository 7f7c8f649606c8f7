"""Export: flattening and naming, the rank-0 hub, and one module per backend."""

from torchtelemetry.export._console import ConsoleExporter
from torchtelemetry.export._flatten import describe_metrics, flatten_results
from torchtelemetry.export._hub import ExporterHealth, ExportHub, NullHub
from torchtelemetry.export._jsonl import JsonlExporter
from torchtelemetry.export._naming import InvalidMetricNameError, NameCollisionError
from torchtelemetry.export._otel import OTelExporter
from torchtelemetry.export._prometheus import PrometheusExporter
from torchtelemetry.export._protocol import (
    Exporter,
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    RunInfo,
    Scalars,
    ScalarValue,
)
from torchtelemetry.export._pushgateway import PushgatewayExporter
from torchtelemetry.export._registry import available_exporters, exporter_class, exporters_from_spec
from torchtelemetry.export._wandb import WandbExporter

__all__ = [
    "ConsoleExporter",
    "ExportHub",
    "ExportResult",
    "Exporter",
    "ExporterHealth",
    "HistogramValue",
    "InvalidMetricNameError",
    "JsonlExporter",
    "MetricDescriptor",
    "NameCollisionError",
    "NullHub",
    "OTelExporter",
    "PrometheusExporter",
    "PushgatewayExporter",
    "RunInfo",
    "ScalarValue",
    "Scalars",
    "WandbExporter",
    "available_exporters",
    "describe_metrics",
    "exporter_class",
    "exporters_from_spec",
    "flatten_results",
]
