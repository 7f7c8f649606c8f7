"""`HistogramMetric`: fixed bucket boundaries, the shape Prometheus and OTel histograms need."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricExample, MetricKind
from torchtelemetry.metric._batched import BatchedRule, States

__all__ = ["HistogramMetric"]


def _results(states: States, bounds: torch.Tensor) -> dict[str, torch.Tensor]:
    """The histograms as `compute()` gives them, with each one's bounds."""
    return {"bounds": bounds, "counts": states["counts"], "sum": states["sum"], "count": states["count"]}


class HistogramMetric(Metric):
    """Counts per bucket with fixed upper bounds, plus the sum and count of values.

    Bucket `i` counts values `v` with `bins[i-1] < v <= bins[i]` (Prometheus `le`
    semantics: a value on an edge falls in the bucket that edge closes); the last
    bucket counts values above `bins[-1]` (`le="+Inf"`). Floating point values are compared
    in their own precision; integer values compare exactly against the bounds, at any size.
    `compute()`: `bounds` (upper bounds), non-cumulative `counts` (one more than bounds), `sum`,
    `count`.

    Example:
        >>> metric = HistogramMetric(bins=[0.1, 1.0])
        >>> metric.update(torch.tensor([0.05, 0.1, 0.5, 2.0]))
        >>> metric.compute()["counts"].tolist()
        [2.0, 1.0, 1.0]
    """

    kind = MetricKind.HISTOGRAM
    batched = BatchedRule(_results, lambda metric: metric.bounds)  # type: ignore[attr-defined]

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        return (
            MetricExample(
                "float batch and 0-d",
                (torch.tensor([0.05, 0.1, 0.5, 20.0]),),
                (torch.tensor(1.0),),
                bins=[0.1, 1.0, 10.0],
            ),
            MetricExample(
                "float16 batch", (torch.tensor([0.1, 0.5, 2.0], dtype=torch.float16),), bins=[0.1, 1.0]
            ),
            MetricExample("integers", (torch.tensor([0, 1, 5, 64]),), bins=[1, 10]),
            MetricExample(
                "ignore NaN", (torch.tensor([0.5, float("nan"), 3.0]),), bins=[1.0], nan_policy="ignore"
            ),
        )

    def __init__(
        self,
        bins: Sequence[float],
        *,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        bounds = [float(b) for b in bins]
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"{self.display_name()}: bins must be a non-empty list of finite numbers")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{self.display_name()}: bins must be strictly increasing, got {bounds}")
        self.bins = bounds
        """The upper bounds as given (floats); `bounds` holds them as a tensor on the metric's device."""
        self.bounds = torch.tensor(bounds, dtype=torch.float64)
        # v <= b exactly when v <= floor(b), for an integer v: integers compare in int64, exactly.
        self.integer_bounds = torch.tensor([_floor_int64(b) for b in bounds], dtype=torch.int64)
        self._one = torch.ones((), dtype=dtype)
        """What one value adds to its bucket."""
        self._bounds_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.counts = MetricAccumulator(torch.zeros(len(bounds) + 1), ReduceOp.SUM, dtype=dtype)
        self.sum = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)
        self.count = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)

    def update(self, value: Any) -> None:
        """Add every entry of `value` to its bucket."""
        value, mask = self._begin_update(value, "value", self.count.device)
        if mask is not None:
            value = torch.where(mask, value, 0)
        elif not value.is_floating_point():
            value = value.long()
        # Compare in the value's own precision, so that a float32 0.1 falls in the bucket `le=0.1` closes.
        buckets = torch.bucketize(value, self._bounds_as(value))
        # The sum first: the only update that can fail (a float value into an integer state dtype,
        # an integer state overflowing), and it fails before any state has changed.
        weights = None if mask is None else mask.to(self.counts.dtype)
        batch = self._batch_sum(self.sum, value, weights)
        self.sum.add_with_count(batch, self.count, value.numel() if weights is None else weights.sum())
        self.counts.add_at_flat(buckets, self._one if weights is None else weights)

    def _bounds_as(self, value: torch.Tensor) -> torch.Tensor:
        """The bounds to compare `value` with, cast once per dtype: in the value's own floating point
        precision, or for int64 the integer bounds (integers compare exactly, at any size)."""
        bounds = self._bounds_by_dtype.get(value.dtype)
        if bounds is None:
            bounds = self.bounds.to(value.dtype) if value.is_floating_point() else self.integer_bounds
            if not torch.compiler.is_compiling():  # a compiled graph keeps its own (no recompile)
                self._bounds_by_dtype[value.dtype] = bounds
        return bounds

    def to(self, device: torch.device | str) -> HistogramMetric:
        super().to(device)
        self._bounds_by_dtype = {}
        return self

    def configuration(self) -> dict[str, Any]:
        return {**super().configuration(), "bins": list(self.bins)}


def _floor_int64(bound: float) -> int:
    """`floor(bound)` clamped to int64 (every int64 lies below a larger bound, above a smaller one)."""
    if bound >= 2.0**63:
        return 2**63 - 1
    if bound < -(2.0**63):
        return -(2**63)
    return math.floor(bound)
