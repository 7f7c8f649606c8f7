"""`sync_metrics`: every accumulator of every metric in one collective per bucket."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from torchtelemetry.metric import Metric, MetricAccumulator, ReduceOp
from torchtelemetry.sync._buckets import BucketKey, BucketLayout
from torchtelemetry.sync._group import GroupLike, comm_device, resolve_group

__all__ = [
    "LayoutMismatchError",
    "SyncHandle",
    "metric_leaves",
    "named_accumulators",
    "reduce_buffers",
    "sync_accumulators",
    "sync_metrics",
]

_DIST_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

# Layouts already checked to agree across the ranks of a group: {group name: {hash}}.
_VERIFIED_LAYOUTS: dict[str, set[int]] = {}


class LayoutMismatchError(ValueError):
    """Ranks hold different metric sets (names, shapes, dtypes or ops)."""


def metric_leaves(metrics: Any, *, op: str = "sync_metrics") -> list[tuple[str, Metric]]:
    """The Metrics of a PyTree (dict, list, tuple, nested) with their paths, e.g. `train/loss`."""
    leaves, _ = pytree.tree_flatten_with_path(metrics)
    named = []
    for path, leaf in leaves:
        name = "/".join(str(_key_name(key)) for key in path) or (getattr(leaf, "name", None) or "metric")
        if not isinstance(leaf, Metric):
            raise TypeError(f"{op}: {name!r} is a {type(leaf).__name__}, expected a Metric")
        named.append((name, leaf))
    return named


def _key_name(key: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def named_accumulators(metrics: Any, *, op: str = "sync_metrics") -> dict[str, MetricAccumulator]:
    """Every accumulator of a PyTree of Metrics, named `path.attribute`."""
    return {
        f"{name}.{attr}": accumulator
        for name, metric in metric_leaves(metrics, op=op)
        for attr, accumulator in metric.accumulators.items()
    }


class SyncHandle:
    """Pending reduction of `sync_metrics(..., async_op=True)`; `wait()` completes it."""

    def __init__(self, works: list[Any], finish: Any) -> None:
        self._works = works
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        """Block until every bucket is reduced and the synchronized states are written."""
        if self._done:
            return
        for work in self._works:
            work.wait()
        self._finish()
        self._done = True


def sync_metrics(metrics: Any, group: GroupLike = None, *, async_op: bool = False) -> SyncHandle | None:
    """Reduce every accumulator of `metrics` (a Metric or a PyTree of them) across `group`.

    All accumulators are packed into one flat buffer per (reduce op, dtype,
    device) bucket and reduced with one collective per bucket. Afterwards each
    accumulator's `value` holds the global state on every rank. Without a
    process group this is a local copy. With `async_op=True` returns a handle
    whose `wait()` completes the sync; otherwise waits and returns None.
    """
    return sync_accumulators(named_accumulators(metrics), group, async_op=async_op)


def sync_accumulators(
    accumulators: Mapping[str, MetricAccumulator],
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> SyncHandle | None:
    """`sync_metrics` for named accumulators."""
    layout = BucketLayout([(name, acc.local, acc.reduce_op) for name, acc in accumulators.items()])
    buffers = layout.pack([acc.local for acc in accumulators.values()])
    works = reduce_buffers(layout, buffers, resolve_group(group, op="sync_metrics"), async_op=async_op)

    def finish() -> None:
        for accumulator, synced in zip(accumulators.values(), layout.unpack(buffers), strict=True):
            accumulator.set_synced(synced)

    handle = SyncHandle(works, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_buffers(
    layout: BucketLayout,
    buffers: dict[BucketKey, torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
) -> list[Any]:
    """All-reduce each packed buffer in place, one collective per bucket, in bucket order.

    The first time a layout is seen on a group, all ranks check that they agree
    on it (one small collective); a mismatch raises `LayoutMismatchError` on
    every rank instead of hanging or mixing up values. Returns the Work handles
    (empty unless `async_op`).
    """
    if group is None:
        return []
    first_device = next(iter(buffers.values())).device if buffers else None
    verify_layout(layout, group, comm_device(group, first_device))
    works = []
    for key in layout.buckets:
        work = dist.all_reduce(buffers[key], op=_DIST_OPS[key.reduce_op], group=group, async_op=async_op)
        if work is not None:
            works.append(work)
    return works


def verify_layout(layout: BucketLayout, group: dist.ProcessGroup, device: torch.device) -> None:
    """Check once per (group, layout) that every rank holds the same layout."""
    verified = _VERIFIED_LAYOUTS.setdefault(group.group_name, set())
    signature_hash = layout.signature_hash()
    if signature_hash in verified:
        return
    probe = torch.tensor([signature_hash, -signature_hash], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if probe.tolist() == [signature_hash, -signature_hash]:
        verified.add(signature_hash)
        return
    signatures: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, layout.names, group=group)
    raise LayoutMismatchError(_describe_mismatch(signatures, dist.get_rank(group)))


def _describe_mismatch(names_per_rank: list[list[str]], rank: int) -> str:
    reference = names_per_rank[0]
    lines = []
    for other_rank, names in enumerate(names_per_rank[1:], start=1):
        only_ref = sorted(set(reference) - set(names))
        only_other = sorted(set(names) - set(reference))
        if only_ref or only_other:
            lines.append(f"rank {other_rank} lacks {only_ref[:5]} and has extra {only_other[:5]} vs rank 0")
    if not lines:
        lines.append("the same state names, but different shapes, dtypes or reduce ops")
    return (
        f"sync_metrics (rank {rank}): ranks hold different metric sets: "
        + "; ".join(lines)
        + "; every rank must create the same metrics with the same shapes and dtypes"
    )
