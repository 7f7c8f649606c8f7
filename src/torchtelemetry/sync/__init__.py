"""Synchronization across ranks: packed buckets, group resolution, functional reductions."""

from torchtelemetry.sync._buckets import BucketKey, BucketLayout
from torchtelemetry.sync._functional import Reduction, all_gather, per_rank, reduce, reduce_custom
from torchtelemetry.sync._group import GroupLike, comm_device, group_rank, group_world_size, resolve_group
from torchtelemetry.sync._sync import (
    LayoutMismatchError,
    SyncHandle,
    metric_leaves,
    named_accumulators,
    reduce_buffers,
    sync_accumulators,
    sync_metrics,
)

__all__ = [
    "BucketKey",
    "BucketLayout",
    "GroupLike",
    "LayoutMismatchError",
    "Reduction",
    "SyncHandle",
    "all_gather",
    "comm_device",
    "group_rank",
    "group_world_size",
    "metric_leaves",
    "named_accumulators",
    "per_rank",
    "reduce",
    "reduce_buffers",
    "reduce_custom",
    "resolve_group",
    "sync_accumulators",
    "sync_metrics",
]
