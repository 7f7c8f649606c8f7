"""Batched compute of the built-in metrics: K instances of one class from their stacked states at once.

A window of many metrics then costs a few tensor ops per class, not per metric. Each rule turns
`states` (attribute name -> the K instances' states stacked along a new leading dim) into the
PyTree `compute()` returns, with the same leading dim on every leaf, and gives the same values
as `compute()` of each instance. Only exact classes have a rule: a subclass (which may override
`compute()`) goes through its own `compute()`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchtelemetry.metric._aggregation import (
    MaxMetric,
    MinMetric,
    PerRankMetric,
    SumMetric,
    WeightedMeanMetric,
)
from torchtelemetry.metric._base import Metric
from torchtelemetry.metric._classification import (
    AccuracyMetric,
    BinaryAUROCMetric,
    ConfusionMatrixMetric,
    confusion_scores,
)
from torchtelemetry.metric._histogram import HistogramMetric

__all__ = ["BatchedRule", "batched_rule"]

States = Mapping[str, torch.Tensor]


def _no_constants(metrics: Sequence[Metric], device: torch.device) -> None:
    return None


@dataclass(frozen=True, slots=True)
class BatchedRule:
    """How one built-in class computes K instances at once."""

    compute: Callable[[States, Any], Any]
    """(stacked states, constants) -> the results PyTree, every leaf with a leading dim of K."""
    constants: Callable[[Sequence[Metric], torch.device], Any] = _no_constants
    """Per-instance constants the results need (histogram bounds), stacked once on `device`."""


def _auroc(states: States, constants: None) -> torch.Tensor:
    tp = states["positives"].flip(-1).cumsum(-1)
    fp = states["negatives"].flip(-1).cumsum(-1)
    zeros = tp.new_zeros(tp.shape[0], 1)
    tpr = torch.cat([zeros, tp / tp[:, -1:]], dim=-1)
    fpr = torch.cat([zeros, fp / fp[:, -1:]], dim=-1)
    return torch.trapezoid(tpr, fpr, dim=-1)


def _histogram_bounds(metrics: Sequence[Metric], device: torch.device) -> torch.Tensor:
    return torch.stack([metric.bounds for metric in metrics]).to(device)  # type: ignore[attr-defined]


_RULES: dict[type, BatchedRule] = {
    SumMetric: BatchedRule(lambda s, c: s["total"]),
    MaxMetric: BatchedRule(lambda s, c: s["extremum"]),
    MinMetric: BatchedRule(lambda s, c: s["extremum"]),
    WeightedMeanMetric: BatchedRule(lambda s, c: s["weighted_sum"] / s["total_weight"]),
    AccuracyMetric: BatchedRule(lambda s, c: s["correct"] / s["total"]),
    PerRankMetric: BatchedRule(lambda s, c: s["sums"] / s["counts"]),
    ConfusionMatrixMetric: BatchedRule(lambda s, c: confusion_scores(s["matrix"])),
    BinaryAUROCMetric: BatchedRule(_auroc),
    HistogramMetric: BatchedRule(
        lambda s, bounds: {"bounds": bounds, "counts": s["counts"], "sum": s["sum"], "count": s["count"]},
        _histogram_bounds,
    ),
}


def batched_rule(metric: Metric) -> BatchedRule | None:
    """The batched compute of `metric`'s exact class, or None (its own `compute()` is used)."""
    return _RULES.get(type(metric))
