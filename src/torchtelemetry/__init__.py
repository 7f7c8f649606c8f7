"""torchtelemetry: GPU-resident PyTorch training metrics, synced across ranks, exported from rank 0."""

from torchtelemetry.export import OTelExporter
from torchtelemetry.metric import (
    AccuracyMetric,
    BinaryAUROCMetric,
    ConfusionMatrixMetric,
    HistogramMetric,
    MaxMetric,
    Metric,
    MetricAccumulator,
    MetricKind,
    MinMetric,
    PerRankMetric,
    ReduceOp,
    SumMetric,
    WeightedMeanMetric,
)
from torchtelemetry.sync import (
    LayoutMismatchError,
    all_gather,
    per_rank,
    reduce,
    reduce_custom,
    sync_metrics,
)

__version__ = "0.1.0"

__all__ = [
    "AccuracyMetric",
    "BinaryAUROCMetric",
    "ConfusionMatrixMetric",
    "HistogramMetric",
    "LayoutMismatchError",
    "MaxMetric",
    "Metric",
    "MetricAccumulator",
    "MetricKind",
    "MinMetric",
    "OTelExporter",
    "PerRankMetric",
    "ReduceOp",
    "SumMetric",
    "WeightedMeanMetric",
    "__version__",
    "all_gather",
    "per_rank",
    "reduce",
    "reduce_custom",
    "sync_metrics",
]
