"""Metrics: GPU-resident, linearly reducible state updated in place."""

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._aggregation import (
    MaxMetric,
    MinMetric,
    PerRankMetric,
    SumMetric,
    WeightedMeanMetric,
)
from torchtelemetry.metric._auroc import BinaryAUROCMetric
from torchtelemetry.metric._base import DEFAULT_LABEL_NAME, Metric, MetricExample, MetricKind, NanPolicy
from torchtelemetry.metric._batched import BatchedRule, batched_rule
from torchtelemetry.metric._binding import MetricBinding
from torchtelemetry.metric._classification import AccuracyMetric, ConfusionMatrixMetric
from torchtelemetry.metric._histogram import HistogramMetric
from torchtelemetry.metric._identity import same_identity, state_identity
from torchtelemetry.metric._inputs import nonfinite_count
from torchtelemetry.metric._reshard import gather_local_states, restore_local_states
from torchtelemetry.metric._staging import STAGED_DTYPES, UpdateStage
from torchtelemetry.metric._sync import SyncHandle, sync_accumulators, sync_metrics
from torchtelemetry.metric._tree import metric_leaves, named_accumulators, named_metric_leaves

__all__ = [
    "DEFAULT_LABEL_NAME",
    "DEFAULT_STATE_DTYPE",
    "STAGED_DTYPES",
    "AccuracyMetric",
    "BatchedRule",
    "BinaryAUROCMetric",
    "ConfusionMatrixMetric",
    "HistogramMetric",
    "MaxMetric",
    "Metric",
    "MetricAccumulator",
    "MetricBinding",
    "MetricExample",
    "MetricKind",
    "MinMetric",
    "NanPolicy",
    "PerRankMetric",
    "ReduceOp",
    "SumMetric",
    "SyncHandle",
    "UpdateStage",
    "WeightedMeanMetric",
    "batched_rule",
    "gather_local_states",
    "metric_leaves",
    "named_accumulators",
    "named_metric_leaves",
    "nonfinite_count",
    "restore_local_states",
    "same_identity",
    "state_identity",
    "sync_accumulators",
    "sync_metrics",
]
