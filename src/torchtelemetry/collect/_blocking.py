"""`sync_and_compute`: one collection of a PyTree of metrics, done now on the calling thread."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtelemetry.collect._window import WindowPlan
from torchtelemetry.metric import metric_leaves
from torchtelemetry.sync import GroupLike, Slot, WindowExchange, group_world_size, resolve_group

__all__ = ["sync_and_compute"]


@dataclass(frozen=True, slots=True)
class _Prepared:
    plan: WindowPlan
    exchange: WindowExchange
    slot: Slot
    targets: list[torch.Tensor]
    spec: Any
    leaves: tuple[Any, ...]
    """The PyTree's leaves, kept alive so that the ids in the cache key stay theirs."""


# Process-global: `sync_and_compute` is a function, so its few recent plans are cached per process.
_PREPARED: OrderedDict[tuple, _Prepared] = OrderedDict()
_MAX_PREPARED = 16


def sync_and_compute(metrics: Any, group: GroupLike = None) -> Any:
    """Reduce `metrics` (a Metric or a PyTree of them) across `group` and return their results now.

    The blocking one-call path, e.g. for evaluation loops: every state in one packed slot, one
    collective while the payload is small (see `WindowExchange`), built-in metrics computed in
    batches, one host copy, results as Python scalars and lists in the structure of the tree.
    Reads the local states without changing them.
    """
    resolved = resolve_group(group, op="sync_and_compute")
    leaves, spec = pytree.tree_flatten(metrics)
    key = (None if resolved is None else resolved.group_name, *map(id, leaves))
    prepared = _PREPARED.get(key)
    if prepared is None or prepared.spec != spec or not prepared.plan.unchanged():
        plan = WindowPlan(metric_leaves(metrics, op="sync_and_compute"), group_world_size(resolved))
        exchange = WindowExchange(plan.layout, resolved)
        slot = exchange.new_slot(plan.device)
        prepared = _Prepared(plan, exchange, slot, plan.layout.views(slot.buffers), spec, tuple(leaves))
        _PREPARED[key] = prepared
        while len(_PREPARED) > _MAX_PREPARED:
            _PREPARED.popitem(last=False)
    _PREPARED.move_to_end(key)
    plan, exchange, slot = prepared.plan, prepared.exchange, prepared.slot
    torch._foreach_copy_(prepared.targets, plan.local_tensors())
    exchange.negate_min_(slot)
    exchange.reduce(slot)
    flat, placement = plan.compute(exchange.reduced(slot))
    return pytree.tree_unflatten(plan.results(flat.cpu(), placement), spec)
