"""`sync_metrics`: every accumulator of every metric in one collective per bucket."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from torchtelemetry.metric import Metric, MetricAccumulator, ReduceOp, layout_generation
from torchtelemetry.sync._buckets import BucketKey, BucketLayout
from torchtelemetry.sync._group import GroupLike, comm_device, resolve_group

__all__ = [
    "LayoutMismatchError",
    "SyncHandle",
    "forget_group",
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
        # Only a bare Metric (no path) is named after itself: an empty key stays empty, and naming
        # rules reject it instead of renaming it silently.
        name = (
            "/".join(str(_key_name(key)) for key in path)
            if path
            else (getattr(leaf, "name", None) or "metric")
        )
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
    leaves, spec = pytree.tree_flatten(metrics)
    key = ("tree", *map(id, leaves))
    plan = _PLANS.get(key)
    if plan is None or plan.generation != layout_generation() or plan.spec != spec:
        plan = _cache_plan(key, named_accumulators(metrics), spec, leaves)
    return _run_plan(plan, group, async_op)


def sync_accumulators(
    accumulators: Mapping[str, MetricAccumulator],
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> SyncHandle | None:
    """`sync_metrics` for named accumulators."""
    key = ("accumulators", *accumulators, *map(id, accumulators.values()))
    plan = _PLANS.get(key)
    if plan is None or plan.generation != layout_generation():
        plan = _cache_plan(key, accumulators, None, [])
    return _run_plan(plan, group, async_op)


@dataclass(frozen=True, slots=True)
class _SyncPlan:
    """What a sync of one set of accumulators needs, built once and reused while nothing changes."""

    layout: BucketLayout
    accumulators: tuple[MetricAccumulator, ...]
    locals: tuple[torch.Tensor, ...]
    """Flat views of each accumulator's local tensor."""
    synced: tuple[torch.Tensor, ...]
    """Flat views of each accumulator's synchronized tensor, written in place by a sync."""
    generation: int
    spec: Any
    leaves: tuple[Any, ...]
    """The PyTree's leaves, kept alive so that the ids in the cache key stay theirs."""


# Sync plans by (kind, *names or ids); a few recent ones, so alternating trees stay cached.
_PLANS: OrderedDict[tuple, _SyncPlan] = OrderedDict()
_MAX_PLANS = 16


def _cache_plan(
    key: tuple, accumulators: Mapping[str, MetricAccumulator], spec: Any, leaves: list[Any]
) -> _SyncPlan:
    accs = tuple(accumulators.values())
    views = [acc.flat_views() for acc in accs]
    plan = _SyncPlan(
        layout=BucketLayout([(name, acc.local, acc.reduce_op) for name, acc in accumulators.items()]),
        accumulators=accs,
        locals=tuple(local for local, _ in views),
        synced=tuple(synced for _, synced in views),
        generation=layout_generation(),
        spec=spec,
        leaves=tuple(leaves),
    )
    _PLANS[key] = plan
    _PLANS.move_to_end(key)
    while len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


def _run_plan(plan: _SyncPlan, group: GroupLike, async_op: bool) -> SyncHandle | None:
    buffers = plan.layout.pack(plan.locals)
    works = reduce_buffers(plan.layout, buffers, resolve_group(group, op="sync_metrics"), async_op=async_op)
    handle = SyncHandle(works, lambda: plan.layout.unpack_into(buffers, plan.synced))
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


def forget_group(group: dist.ProcessGroup) -> None:
    """Drop what `verify_layout` remembers of `group` (call when destroying it)."""
    _VERIFIED_LAYOUTS.pop(group.group_name, None)


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
    dist.all_gather_object(signatures, layout.signature, group=group)
    raise LayoutMismatchError(_describe_mismatch(signatures, dist.get_rank(group)))


def _describe_mismatch(signatures: list[str], rank: int) -> str:
    """Name the states that differ between rank 0 and each other rank (at most 5 each)."""
    entries = [
        dict(entry.split(":", 1) for entry in signature.split(";") if entry) for signature in signatures
    ]
    reference = entries[0]
    lines = []
    for other_rank, other in enumerate(entries[1:], start=1):
        only_ref = sorted(set(reference) - set(other))
        only_other = sorted(set(other) - set(reference))
        differ = [
            f"{name!r} is {reference[name]} on rank 0 but {other[name]} on rank {other_rank}"
            for name in reference
            if name in other and reference[name] != other[name]
        ]
        if only_ref or only_other:
            lines.append(f"rank {other_rank} lacks {only_ref[:5]} and has extra {only_other[:5]} vs rank 0")
        lines.extend(differ[:5])
        if not (only_ref or only_other or differ) and list(reference) != list(other):
            lines.append(f"rank {other_rank} holds the same states as rank 0 in a different order")
    return (
        f"sync_metrics (rank {rank}): ranks hold different metric sets: "
        + "; ".join(lines)
        + "; every rank must create the same metrics (same names, shapes, dtypes and ops, in the same order)"
    )
