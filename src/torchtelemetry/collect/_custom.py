"""The twins a window computes a custom metric through: one whose tensor attributes are on the
device the window computes on, and one whose accumulators read the window's state."""

from __future__ import annotations

import copy

import torch

from torchtelemetry.metric import Metric, MetricAccumulator

__all__ = ["reading_twin", "twin_on"]


def twin_on(metric: Metric, device: torch.device) -> Metric:
    """`metric`, or a shallow copy whose tensor attributes (those `Metric.to()` moves) are copied to
    `device`: a custom `compute()` on another device than the metric's reads these copies. The copy
    shares the metric's accumulators, so it reads the window's state through `value`."""
    moved = {
        attr: value.to(device)
        for attr, value in vars(metric).items()
        if isinstance(value, torch.Tensor) and value.device != device
    }
    if not moved:
        return metric
    twin = copy.copy(metric)
    for attr, value in moved.items():
        object.__setattr__(twin, attr, value)
    return twin


def reading_twin(metric: Metric, accumulators: dict[str, MetricAccumulator]) -> Metric:
    """A twin of `metric` whose accumulators are `accumulators` (by attribute: readers of a window's
    state): its `compute()` gives the window's results, and the metric itself, which the training
    thread goes on updating, is not touched."""
    twin = object.__new__(type(metric))
    twin.__dict__.update(metric.__dict__)
    twin.__dict__.pop("_binding", None)
    twin.__dict__.update(accumulators)
    twin.__dict__["_accumulators"] = accumulators
    return twin
