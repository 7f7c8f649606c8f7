"""`BatchedRule`: a built-in metric's compute, written once for K instances at once.

A built-in class holds its rule (`Metric.batched`); its `compute()` is that rule with K = 1, and a
collection window computes the K instances of the class that it holds with one call of the same
rule (`batched_rule`), so a window of many metrics costs a few tensor ops per class, not per
metric. A rule turns `states` (attribute name -> the K instances' states stacked along a new
leading dim) into the PyTree of results, with the same leading dim on every leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torchtelemetry.metric._base import Metric

__all__ = ["BatchedRule", "States", "batched_rule"]

States = Mapping[str, torch.Tensor]


def _no_constants(metrics: Sequence[Metric], device: torch.device) -> None:
    return None


def _one(leaf: Any) -> Any:
    """The only instance of a K = 1 result leaf: a copy where it is a view (of the state, maybe)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    one = leaf.squeeze(0)
    return one.clone() if leaf._is_view() else one


@dataclass(frozen=True, slots=True)
class BatchedRule:
    """How one built-in class computes K instances at once."""

    compute: Callable[[States, Any], Any]
    """(stacked states, constants) -> the results PyTree, every leaf with a leading dim of K."""
    constants: Callable[[Sequence[Metric], torch.device], Any] = _no_constants
    """Per-instance constants the results need (histogram bounds), stacked once on `device`."""

    def compute_one(self, metric: Metric) -> Any:
        """`metric`'s results: the rule with K = 1, on the state each accumulator's `value` gives
        (new tensors, never views of the state)."""
        states = {attr: acc.value.unsqueeze(0) for attr, acc in metric._accumulators.items()}
        constants = None if self.constants is _no_constants else self.constants([metric], metric.device)
        results = self.compute(states, constants)
        if isinstance(results, torch.Tensor):
            return _one(results)
        if type(results) is dict:
            return {key: _one(leaf) for key, leaf in results.items()}
        return pytree.tree_map(_one, results)


def batched_rule(metric: Metric) -> BatchedRule | None:
    """The rule of `metric`'s class when its `compute()` is that rule, else None (a custom metric,
    or a subclass overriding `compute()`, computes through its own `compute()`)."""
    from torchtelemetry.metric._base import Metric  # _base imports this module

    cls = type(metric)
    return cls.batched if cls.compute is Metric.compute else None
