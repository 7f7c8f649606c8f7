"""Synchronization across ranks: packed buckets, group resolution, functional reductions."""

from torchtelemetry.sync._buckets import BucketKey, BucketLayout
from torchtelemetry.sync._exchange import GATHER_LIMIT_BYTES, Slot, WindowExchange
from torchtelemetry.sync._functional import Reduction, all_gather, per_rank, reduce, reduce_custom
from torchtelemetry.sync._group import GroupLike, comm_device, group_rank, group_world_size, resolve_group
from torchtelemetry.sync._reshard import gather_local_states, restore_local_states
from torchtelemetry.sync._sync import (
    LayoutMismatchError,
    SyncHandle,
    forget_group,
    metric_leaves,
    named_accumulators,
    reduce_buffers,
    sync_accumulators,
    sync_metrics,
)
from torchtelemetry.sync._window import STEPS_ENTRY, WindowMismatchError, WindowPlan, sync_and_compute

__all__ = [
    "GATHER_LIMIT_BYTES",
    "STEPS_ENTRY",
    "BucketKey",
    "BucketLayout",
    "GroupLike",
    "LayoutMismatchError",
    "Reduction",
    "Slot",
    "SyncHandle",
    "WindowExchange",
    "WindowMismatchError",
    "WindowPlan",
    "all_gather",
    "comm_device",
    "forget_group",
    "group_rank",
    "gather_local_states",
    "group_world_size",
    "metric_leaves",
    "named_accumulators",
    "per_rank",
    "reduce",
    "reduce_buffers",
    "reduce_custom",
    "resolve_group",
    "restore_local_states",
    "sync_accumulators",
    "sync_and_compute",
    "sync_metrics",
]
