"""Export: the `Exporter` protocol, the `BaseExporter` lifecycle, the rank-0 hub, one module per backend.

The values a report carries (`HistogramValue`, `MetricDescriptor`, `Scalars`) come from
`torchtelemetry.report` and are re-exported here for exporter authors.
"""

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._console import ConsoleExporter
from torchtelemetry.export._exposition import ROUTE_LABEL, ROUTES, RUN_LABEL
from torchtelemetry.export._health import HEALTH_DESCRIPTORS, ExporterHealth
from torchtelemetry.export._histograms import OUTER_BUCKET_FIELDS, DrawnHistogram, drawn_histogram
from torchtelemetry.export._hub import ExportHub, NullHub
from torchtelemetry.export._jsonl import JsonlExporter
from torchtelemetry.export._mlflow import MLflowExporter
from torchtelemetry.export._otel import OTEL_SCHEMA_URL, OTelExporter
from torchtelemetry.export._prometheus import UNKNOWN_INTERVAL_S, PrometheusExporter, final_scrape_due
from torchtelemetry.export._protocol import RUN_ID_ENV, Exporter, ExporterStartError, ExportResult, RunInfo
from torchtelemetry.export._pushgateway import PushgatewayExporter
from torchtelemetry.export._registry import available_exporters, exporter_class, exporters_from_spec
from torchtelemetry.export._signal_registry import (
    SIGNAL_REGISTRY_SCHEMA_VERSION,
    render_signal_registry,
    signal_registry,
)
from torchtelemetry.export._temporality import Temporality
from torchtelemetry.export._tensorboard import TensorBoardExporter
from torchtelemetry.export._wandb import WandbExporter
from torchtelemetry.report import HistogramValue, MetricDescriptor, Scalars, ScalarValue

__all__ = [
    "HEALTH_DESCRIPTORS",
    "OTEL_SCHEMA_URL",
    "OUTER_BUCKET_FIELDS",
    "ROUTES",
    "ROUTE_LABEL",
    "RUN_ID_ENV",
    "RUN_LABEL",
    "SIGNAL_REGISTRY_SCHEMA_VERSION",
    "UNKNOWN_INTERVAL_S",
    "BaseExporter",
    "ConsoleExporter",
    "DrawnHistogram",
    "ExportHub",
    "ExportFailed",
    "ExportResult",
    "Exporter",
    "ExporterHealth",
    "ExporterStartError",
    "HistogramValue",
    "JsonlExporter",
    "MLflowExporter",
    "MetricDescriptor",
    "NullHub",
    "OTelExporter",
    "PrometheusExporter",
    "PushgatewayExporter",
    "RunInfo",
    "ScalarValue",
    "Scalars",
    "TensorBoardExporter",
    "Temporality",
    "WandbExporter",
    "available_exporters",
    "drawn_histogram",
    "exporter_class",
    "exporters_from_spec",
    "final_scrape_due",
    "render_signal_registry",
    "signal_registry",
]
