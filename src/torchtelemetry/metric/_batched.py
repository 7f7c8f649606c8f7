"""`BatchedRule`: a built-in metric's compute, written once for one instance and for K at once.

A built-in class holds its rule (`Metric.batched`). A rule takes states with any leading dims:
`compute()` runs it on the instance's own states, and a collection on the K instances of the class
it holds, their states stacked along a new leading dim (`batched_rule`), so a collection of many
metrics costs a few tensor ops per class, not per metric.
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


def _copied(leaf: Any, inputs: tuple[Any, ...]) -> Any:
    """A result leaf that is (a view of) an input, copied: a result never aliases a state."""
    if isinstance(leaf, torch.Tensor):
        if leaf._is_view():
            return leaf.clone()
        for given in inputs:
            if leaf is given:
                return leaf.clone()
    return leaf


@dataclass(frozen=True, slots=True)
class BatchedRule:
    """How one built-in class computes its results, for one instance or K at once."""

    compute: Callable[[States, Any], Any]
    """(states, constant) -> the results PyTree. States (and constants) with a leading dim of K give
    every leaf that leading dim; the states of one instance, its results."""
    constant: Callable[[Metric], torch.Tensor] | None = None
    """The per-instance tensor the results need besides the states (a histogram's bounds)."""

    def constants(self, metrics: Sequence[Metric], device: torch.device) -> torch.Tensor | None:
        """The constants of `metrics` stacked along a new leading dim on `device` (None without)."""
        if self.constant is None:
            return None
        return torch.stack([self.constant(metric) for metric in metrics]).to(device)

    def compute_one(self, metric: Metric) -> Any:
        """`metric`'s results from the state each accumulator's `value` gives (new tensors, never
        the state or a view of it)."""
        states = {attr: acc.value for attr, acc in metric._accumulators.items()}
        constant = None if self.constant is None else self.constant(metric)
        results = self.compute(states, constant)
        inputs = (*states.values(), constant)
        if isinstance(results, torch.Tensor):
            return _copied(results, inputs)
        if type(results) is dict:
            return {key: _copied(leaf, inputs) for key, leaf in results.items()}
        return pytree.tree_map(lambda leaf: _copied(leaf, inputs), results)


def batched_rule(metric: Metric) -> BatchedRule | None:
    """The rule of `metric`'s class when its `compute()` is that rule, else None (a custom metric,
    or a subclass overriding `compute()`, computes through its own `compute()`)."""
    from torchtelemetry.metric._base import Metric  # _base imports this module

    cls = type(metric)
    return cls.batched if cls.compute is Metric.compute else None
