"""`sync_metrics`: every accumulator of every metric in one collective per bucket."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtelemetry.metric._accumulator import MetricAccumulator, same_layout, state_layout
from torchtelemetry.metric._tree import metric_leaves, named_accumulators
from torchtelemetry.sync import BucketLayout, GroupLike, reduce_buffers, resolve_group

__all__ = ["SyncHandle", "sync_accumulators", "sync_metrics"]


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
    if plan is None or plan.spec != spec or not _unchanged(plan, _tree_accumulators(leaves)):
        configs = {name: metric.configuration() for name, metric in metric_leaves(metrics)}
        plan = _cache_plan(key, named_accumulators(metrics), spec, leaves, configs)
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
    if plan is None or not _unchanged(plan, accumulators.values()):
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
    state_layout: tuple[object, ...]
    """`state_layout` of the accumulators when built: the plan holds while it is the same."""
    spec: Any
    leaves: tuple[Any, ...]
    """The PyTree's leaves, kept alive so that the ids in the cache key stay theirs."""


# Sync plans by (kind, *names or ids); a few recent ones, so alternating trees stay cached.
_PLANS: OrderedDict[tuple, _SyncPlan] = OrderedDict()
_MAX_PLANS = 16


def _cache_plan(
    key: tuple,
    accumulators: Mapping[str, MetricAccumulator],
    spec: Any,
    leaves: list[Any],
    configs: Mapping[str, Mapping[str, Any]] | None = None,
) -> _SyncPlan:
    accs = tuple(accumulators.values())
    views = [acc.flat_views() for acc in accs]
    plan = _SyncPlan(
        layout=BucketLayout(
            [(name, acc.local, acc.reduce_op) for name, acc in accumulators.items()], configs
        ),
        accumulators=accs,
        locals=tuple(local for local, _ in views),
        synced=tuple(synced for _, synced in views),
        state_layout=state_layout(accs),
        spec=spec,
        leaves=tuple(leaves),
    )
    _PLANS[key] = plan
    _PLANS.move_to_end(key)
    while len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


def _tree_accumulators(leaves: list[Any]) -> Iterator[MetricAccumulator]:
    return (accumulator for leaf in leaves for accumulator in leaf._accumulators.values())


def _unchanged(plan: _SyncPlan, accumulators: Iterable[MetricAccumulator]) -> bool:
    """Whether the metrics still hold the accumulators (and local tensors) `plan` was built on."""
    return same_layout(plan.state_layout, state_layout(accumulators))


def _run_plan(plan: _SyncPlan, group: GroupLike, async_op: bool) -> SyncHandle | None:
    buffers = plan.layout.pack(plan.locals)
    works = reduce_buffers(plan.layout, buffers, resolve_group(group, op="sync_metrics"), async_op=async_op)
    handle = SyncHandle(works, lambda: plan.layout.unpack_into(buffers, plan.synced))
    if async_op:
        return handle
    handle.wait()
    return None
