"""Export: the `Exporter` protocol, the `BaseExporter` lifecycle, the rank-0 hub, one module per backend.

How each backend spells a metric path (`prometheus_name`, `otel_name`, `TrackerKeys`, ...) is
here, beside the exporters that use it. The values a report carries (`HistogramValue`,
`MetricDescriptor`, `ReportValues`, and their `MetricKind`) come from `torchtelemetry.report` and
`torchtelemetry.metric` and are re-exported here for exporter authors.
"""

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._console import ConsoleExporter
from torchtelemetry.export._console_lines import (
    print_startup_line,
    print_window_line,
    prints_every_report,
    startup_line,
    window_line,
)
from torchtelemetry.export._exposition import ROUTE_LABEL, ROUTES, RUN_LABEL
from torchtelemetry.export._final_scrape import (
    DEFAULT_LINGER_S,
    UNKNOWN_INTERVAL_S,
    FinalScrapeWait,
    final_scrape_due,
)
from torchtelemetry.export._health import HEALTH_DESCRIPTORS, ExporterHealth
from torchtelemetry.export._histograms import OUTER_BUCKET_FIELDS, DrawnHistogram, drawn_histogram
from torchtelemetry.export._hub import ExportHub, NullHub
from torchtelemetry.export._jsonl import JsonlExporter
from torchtelemetry.export._mlflow import MLflowExporter
from torchtelemetry.export._naming import (
    LAST_UPDATE_METRIC,
    NAMESPACE,
    RUN_FINISHED_METRIC,
    STEP_METRIC,
    TrackerKeys,
    check_unique,
    merge_descriptors,
    otel_name,
    otel_unit,
    prometheus_label_name,
    prometheus_name,
    tracker_label_name,
    tracker_name,
)
from torchtelemetry.export._otel import OTEL_SCHEMA_URL, OTelExporter
from torchtelemetry.export._otlp_spans import OtlpSpanSender, SpanRecord
from torchtelemetry.export._prometheus import PrometheusExporter
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
from torchtelemetry.export._urls import redact_url
from torchtelemetry.export._wandb import WandbExporter
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import (
    HistogramValue,
    MetricDescriptor,
    NameCollisionError,
    ReportValue,
    ReportValues,
)

__all__ = [
    "HEALTH_DESCRIPTORS",
    "LAST_UPDATE_METRIC",
    "NAMESPACE",
    "OTEL_SCHEMA_URL",
    "OUTER_BUCKET_FIELDS",
    "ROUTES",
    "ROUTE_LABEL",
    "RUN_ID_ENV",
    "RUN_FINISHED_METRIC",
    "RUN_LABEL",
    "SIGNAL_REGISTRY_SCHEMA_VERSION",
    "STEP_METRIC",
    "UNKNOWN_INTERVAL_S",
    "DEFAULT_LINGER_S",
    "FinalScrapeWait",
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
    "MetricKind",
    "NameCollisionError",
    "NullHub",
    "OTelExporter",
    "OtlpSpanSender",
    "SpanRecord",
    "PrometheusExporter",
    "PushgatewayExporter",
    "RunInfo",
    "ReportValue",
    "ReportValues",
    "TensorBoardExporter",
    "Temporality",
    "TrackerKeys",
    "WandbExporter",
    "available_exporters",
    "check_unique",
    "drawn_histogram",
    "exporter_class",
    "exporters_from_spec",
    "final_scrape_due",
    "render_signal_registry",
    "signal_registry",
    "merge_descriptors",
    "otel_name",
    "otel_unit",
    "prometheus_label_name",
    "prometheus_name",
    "print_startup_line",
    "print_window_line",
    "prints_every_report",
    "redact_url",
    "startup_line",
    "tracker_label_name",
    "tracker_name",
    "window_line",
]
