"""Export: flattening and naming, the rank-0 hub, and one module per backend."""

from torchtelemetry.export._flatten import describe_metrics, flatten_results
from torchtelemetry.export._naming import InvalidMetricNameError, NameCollisionError
from torchtelemetry.export._otel import OTelExporter
from torchtelemetry.export._protocol import (
    Exporter,
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    RunInfo,
    Scalars,
    ScalarValue,
)

__all__ = [
    "ExportResult",
    "Exporter",
    "HistogramValue",
    "InvalidMetricNameError",
    "MetricDescriptor",
    "NameCollisionError",
    "OTelExporter",
    "RunInfo",
    "ScalarValue",
    "Scalars",
    "describe_metrics",
    "flatten_results",
]
