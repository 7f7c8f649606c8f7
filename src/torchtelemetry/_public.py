"""Every public name of the top level, imported (by `torchtelemetry.__getattr__` on first use).

The package's `__init__` imports only its version, so `torchtelemetry --version` and the command
line's dispatch answer without importing torch; the first public name a program touches imports
them all, from here. The names listed are `torchtelemetry.__all__`: imported here, used there.
"""

# ruff: noqa: F401

from torchtelemetry.collect import AsyncMetricCollector, CollectionError, sync_and_compute
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import (
    ConsoleExporter,
    JsonlExporter,
    MLflowExporter,
    OTelExporter,
    PrometheusExporter,
    PushgatewayExporter,
    TensorBoardExporter,
    WandbExporter,
)
from torchtelemetry.metric import (
    AccuracyMetric,
    BinaryAUROCMetric,
    ConfusionMatrixMetric,
    HistogramMetric,
    MaxMetric,
    Metric,
    MetricAccumulator,
    MinMetric,
    PerRankMetric,
    SumMetric,
    WeightedMeanMetric,
    sync_metrics,
)
from torchtelemetry.stop import StopOnSignal
from torchtelemetry.telemetry import RunIdentity, Telemetry, TelemetryStartupError
