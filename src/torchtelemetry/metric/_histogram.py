"""`HistogramMetric`: fixed bucket boundaries, the shape Prometheus and OTel histograms need."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricKind

__all__ = ["HistogramMetric"]


class HistogramMetric(Metric):
    """Counts per bucket with fixed upper bounds, plus the sum and count of values.

    Bucket `i` counts values `v` with `bins[i-1] < v <= bins[i]` (Prometheus `le`
    semantics: a value on an edge falls in the bucket that edge closes); the last
    bucket counts values above `bins[-1]` (`le="+Inf"`).
    """

    kind = MetricKind.HISTOGRAM

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
        self.bounds = torch.tensor(bounds, dtype=dtype)
        self.counts = MetricAccumulator(torch.zeros(len(bounds) + 1), ReduceOp.SUM, dtype=dtype)
        self.sum = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)
        self.count = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)

    def update(self, value: Any) -> None:
        """Add every entry of `value` to its bucket."""
        value = self._as_tensor(value, "value").reshape(-1)
        self._check_finite(value, "value")
        mask = self._finite_mask(value)
        weights = torch.ones_like(value, dtype=self.counts.dtype)
        if mask is not None:
            weights = mask.to(weights.dtype)
            value = torch.where(mask, value, 0)
        # Compare in the value's own precision, so that a float32 0.1 falls in the bucket `le=0.1` closes.
        if value.is_floating_point():
            buckets = torch.bucketize(value, self.bounds.to(value.dtype))
        else:
            buckets = torch.bucketize(value.to(self.bounds.dtype), self.bounds)
        counts = torch.zeros(self.bounds.numel() + 1, dtype=self.counts.dtype, device=value.device)
        counts.index_add_(0, buckets, weights)
        # The sum first: the only update that can fail (a float value into an integer state dtype),
        # and it fails before any state has changed.
        self.sum.update((value * weights).sum())
        self.counts.update(counts)
        self.count.update(weights.sum())

    def compute(self) -> dict[str, torch.Tensor]:
        """`bounds` (upper bounds), non-cumulative `counts` (one more than bounds), `sum`, `count`."""
        return {
            "bounds": self.bounds.clone(),
            "counts": self.counts.value.clone(),
            "sum": self.sum.value.clone(),
            "count": self.count.value.clone(),
        }
