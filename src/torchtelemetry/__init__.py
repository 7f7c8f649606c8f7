"""torchtelemetry: GPU-resident PyTorch training metrics, synced across ranks, exported from rank 0.

The top level holds what a training script uses; the building blocks live in their subpackages,
each importing only those before it (.importlinter): `torchtelemetry.sync` (collectives over packed
tensors, functional reductions), `torchtelemetry.metric` (metrics, `sync_metrics`),
`torchtelemetry.collect` (windows collected off the training loop), `torchtelemetry.report` (named
values, naming rules), `torchtelemetry.export` (the `Exporter` protocol, the hub, the backends),
`Telemetry`, and `torchtelemetry.integrations` (framework adapters).
"""

from torchtelemetry._version import __version__
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

__all__ = [
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
