"""`sync_metrics`: every accumulator of every metric in one collective per bucket."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtelemetry.metric._accumulator import MetricAccumulator
from torchtelemetry.metric._identity import same_identity, state_identity, synced_identity
from torchtelemetry.metric._staging import UpdateStage
from torchtelemetry.metric._tree import metric_leaves, named_accumulators
from torchtelemetry.sync import BucketKey, BucketLayout, GroupLike, reduce_buffers, resolve_group

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
    views = _SYNC_VIEWS.get(key)
    if views is None or views.spec != spec or not views.unchanged(_tree_accumulators(leaves)):
        configs = {name: metric.configuration() for name, metric in metric_leaves(metrics)}
        views = _cache_views(key, named_accumulators(metrics), spec, leaves, configs)
    return _run_views(views, group, async_op)


def sync_accumulators(
    accumulators: Mapping[str, MetricAccumulator],
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> SyncHandle | None:
    """`sync_metrics` for named accumulators."""
    key = ("accumulators", *accumulators, *map(id, accumulators.values()))
    views = _SYNC_VIEWS.get(key)
    if views is None or not views.unchanged(tuple(accumulators.values())):
        views = _cache_views(key, accumulators, None, [])
    return _run_views(views, group, async_op)


@dataclass(slots=True)
class _SyncViews:
    """What a sync of one set of accumulators reads and writes, built once and reused while the
    accumulators (and their local and synchronized tensors) stay the same: every synchronized state
    is a view of one packed buffer per bucket, which a sync fills from the locals (one `cat` per
    bucket) and reduces in place (one collective per bucket), so nothing is copied back."""

    layout: BucketLayout
    accumulators: tuple[MetricAccumulator, ...]
    locals: tuple[torch.Tensor, ...]
    """Each accumulator's local tensor, flat."""
    buffers: dict[BucketKey, torch.Tensor]
    """The packed synchronized states (MIN entries negated while a sync is in flight)."""
    identity: tuple[object, ...]
    """`state_identity` and `synced_identity` of the accumulators when built: the views hold while
    they are the same."""
    stages: tuple[UpdateStage, ...]
    """Where the accumulators' updates are staged: applied before the locals are read."""
    spec: Any
    leaves: tuple[Any, ...]
    """The PyTree's leaves, kept alive so that the ids in the cache key stay theirs."""
    in_flight: SyncHandle | None = None
    """The last sync, until waited for: the next one waits for it (they share the buffers)."""

    def unchanged(self, accumulators: Sequence[MetricAccumulator]) -> bool:
        return same_identity(self.identity, _identity(accumulators))


# Sync views by (kind, *names or ids); a few recent ones, so alternating trees stay cached
# (docs/collection.md, "State").
# Process-global: `sync_metrics` is a function, so its views are cached per process.
_SYNC_VIEWS: OrderedDict[tuple, _SyncViews] = OrderedDict()
_MAX_SYNC_VIEWS = 16


def _identity(accumulators: Sequence[MetricAccumulator]) -> tuple[object, ...]:
    return state_identity(accumulators) + synced_identity(accumulators)


def _cache_views(
    key: tuple,
    accumulators: Mapping[str, MetricAccumulator],
    spec: Any,
    leaves: list[Any],
    configs: Mapping[str, Mapping[str, Any]] | None = None,
) -> _SyncViews:
    accs = tuple(accumulators.values())
    layout = BucketLayout([(name, acc.local, acc.reduce_op) for name, acc in accumulators.items()], configs)
    buffers = layout.storage([acc.local for acc in accs])
    for acc, view in zip(accs, layout.views(buffers), strict=True):
        acc.adopt_synced(view)
    views = _SyncViews(
        layout=layout,
        accumulators=accs,
        locals=tuple(acc.local.view(-1) for acc in accs),
        buffers=buffers,
        identity=_identity(accs),
        stages=tuple({id(stage): stage for acc in accs if (stage := acc.stage) is not None}.values()),
        spec=spec,
        leaves=tuple(leaves),
    )
    _SYNC_VIEWS[key] = views
    _SYNC_VIEWS.move_to_end(key)
    while len(_SYNC_VIEWS) > _MAX_SYNC_VIEWS:
        _SYNC_VIEWS.popitem(last=False)
    return views


def _run_views(views: _SyncViews, group: GroupLike, async_op: bool) -> SyncHandle | None:
    if views.in_flight is not None:
        views.in_flight.wait()
    for stage in views.stages:
        stage.flush()
    views.layout.pack_into(views.locals, views.buffers)
    works = reduce_buffers(
        views.layout, views.buffers, resolve_group(group, op="sync_metrics"), async_op=async_op
    )
    handle = SyncHandle(works, functools.partial(_finish, views))
    views.in_flight = handle
    if async_op:
        return handle
    handle.wait()
    return None


def _tree_accumulators(leaves: list[Any]) -> tuple[MetricAccumulator, ...]:
    return tuple(accumulator for leaf in leaves for accumulator in leaf._accumulators.values())


def _finish(views: _SyncViews) -> None:
    views.layout.negate_min_(views.buffers)
    views.in_flight = None
