"""Collectives over tensors, knowing nothing of `Metric`: packed buckets, group resolution, reductions.

The lowest layer: `torchtelemetry.metric` builds `Metric.sync()` and `sync_metrics` on
`BucketLayout` and `reduce_buffers`, `torchtelemetry.collect` its windows on `WindowExchange`.
"""

from torchtelemetry.sync._buckets import BucketKey, BucketLayout, ReduceOp
from torchtelemetry.sync._cost import LINK_BYTES_PER_S, STEP_LATENCY_S, WindowCost, ring_all_reduce
from torchtelemetry.sync._exchange import GATHER_LIMIT_BYTES, Slot, WindowExchange, slot_holding, window_cost
from torchtelemetry.sync._functional import Reduction, all_gather, per_rank, reduce, reduce_custom
from torchtelemetry.sync._group import GroupLike, comm_device, group_rank, group_world_size, resolve_group
from torchtelemetry.sync._reduce import LayoutMismatchError, forget_group, reduce_buffers

__all__ = [
    "GATHER_LIMIT_BYTES",
    "LINK_BYTES_PER_S",
    "STEP_LATENCY_S",
    "BucketKey",
    "BucketLayout",
    "GroupLike",
    "LayoutMismatchError",
    "ReduceOp",
    "Reduction",
    "Slot",
    "WindowCost",
    "WindowExchange",
    "all_gather",
    "comm_device",
    "forget_group",
    "group_rank",
    "group_world_size",
    "per_rank",
    "reduce",
    "reduce_buffers",
    "reduce_custom",
    "resolve_group",
    "ring_all_reduce",
    "slot_holding",
    "window_cost",
]
