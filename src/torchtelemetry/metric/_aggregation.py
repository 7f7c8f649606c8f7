"""Aggregating metrics: sum, weighted mean, max, min and per-rank means."""

from __future__ import annotations

from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricExample, MetricKind
from torchtelemetry.metric._batched import BatchedRule

__all__ = ["MaxMetric", "MinMetric", "PerRankMetric", "SumMetric", "WeightedMeanMetric"]


class SumMetric(Metric):
    """Sum of every value seen; `kind="counter"` exports a running total (tokens, samples).

    Example:
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.5]))
        >>> metric.update(4)
        >>> metric.compute().item()
        7.5
    """

    batched = BatchedRule(lambda states, _: states["total"])

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        return (
            MetricExample("vector", (torch.tensor([1.0, 2.5, 4.0]),), (torch.tensor([0.5]),)),
            MetricExample(
                "0-d, float16 and Python numbers",
                (torch.tensor(3.0),),
                (torch.tensor([0.5, 1.5], dtype=torch.float16),),
                (512,),
                (0.25,),
            ),
            MetricExample("ignore NaN", (torch.tensor([1.0, float("nan"), 3.0]),), nan_policy="ignore"),
            MetricExample(
                "counter, int64 state", (torch.tensor([3, 4]),), (7,), kind="counter", dtype=torch.int64
            ),
        )

    def __init__(
        self,
        *,
        kind: MetricKind | str = MetricKind.GAUGE,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(kind=kind, **options)
        if self.kind is MetricKind.HISTOGRAM:
            raise ValueError(f"{self.display_name()}: kind must be 'gauge' or 'counter', got 'histogram'")
        self.total = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)

    def update(self, value: Any) -> None:
        """Add the sum of `value` (a tensor of any shape or a number), summed in the state dtype."""
        value, mask = self._begin_update(value)
        if mask is not None:
            value = torch.where(mask, value, 0)
        if self.kind is MetricKind.COUNTER and self._inspects_values(value) and _any_negative(value):
            raise ValueError(f"{self.display_name()}: a counter cannot decrease, got a negative value")
        self.total.update(self._batch_sum(self.total, value))


class WeightedMeanMetric(Metric):
    """Mean of values weighted by `weight` (e.g. loss weighted by token count).

    The state is the weighted sum and the total weight, never the mean, so it
    reduces exactly across ranks and windows. `compute()`: the weighted mean; NaN when no weight
    was seen.

    Example:
        >>> metric = WeightedMeanMetric()
        >>> metric.update(torch.tensor(2.0), 3)  # a loss and its token count
        >>> metric.update(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 0.0]))
        >>> metric.compute().item()
        1.75
    """

    batched = BatchedRule(lambda states, _: states["weighted_sum"] / states["total_weight"])

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        return (
            MetricExample(
                "loss and token count", (torch.tensor(2.5), 100), (torch.tensor(1.25), torch.tensor(300))
            ),
            MetricExample("default weight", (torch.tensor(2.0),), (0.5,)),
            MetricExample(
                "vector and weights",
                (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])),
                (torch.tensor([4.0, 0.5]), 2.0),
            ),
            MetricExample(
                "ignore NaN",
                (torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 2.0, 1.0])),
                nan_policy="ignore",
            ),
            MetricExample(
                "float32 state", (torch.tensor(2.0), 3), (torch.tensor(4.0), 1), dtype=torch.float32
            ),
        )

    def __init__(self, *, dtype: torch.dtype = DEFAULT_STATE_DTYPE, **options: Any) -> None:
        super().__init__(**options)
        self.weighted_sum = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)
        self.total_weight = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)
        self._float_state = dtype.is_floating_point

    def update(self, value: Any, weight: Any = 1.0) -> None:
        """Add `value` with `weight` (a scalar, or a tensor of the same shape as `value`)."""
        weighted_sum, total_weight = self.weighted_sum, self.total_weight
        # The common case (a loss and its token count: two 0-d operands) is checked in one
        # expression; the rest takes the full prologue, which converts the inputs and says what is
        # wrong with them.
        scalars = self._float_state and self._ready_scalars(value, weight, weighted_sum.device)
        if not scalars:
            value, weight = self._checked(value, weight)
            scalars = self._float_state and not (value.dim() or weight.dim())
        if scalars:
            # Two 0-d operands: the product and the weight, in the state dtype (no reduction).
            weighted_sum.add_with_count(value, total_weight, weight, weight)
            return
        weight = weight.expand(value.shape)
        # Both sums before any state changes: either can raise (an integer state overflowing).
        weighted = self._batch_sum(weighted_sum, value, weight)
        weights = self._batch_sum(total_weight, weight)
        weighted_sum.update(weighted)
        total_weight.update(weights)

    def _checked(self, value: Any, weight: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The full prologue: both inputs as tensors on the metric's device, shapes that fit, a weight
        not negative (read where values may be read), nan_policy applied (masked entries count 0)."""
        device = self.weighted_sum.device
        value, mask = self._begin_update(value, "value", device)
        weight, weight_mask = self._input(weight, "weight", device)
        if weight.dim() > 0 and weight.shape != value.shape:
            raise ValueError(
                f"{self.display_name()}: weight has shape {tuple(weight.shape)}, expected the shape of "
                f"value {tuple(value.shape)} or a scalar"
            )
        if self._inspects_values(weight) and _any_negative(weight):
            raise ValueError(f"{self.display_name()}: weight must be non-negative, got a negative weight")
        if mask is None and weight_mask is None:
            return value, weight
        weight = weight.expand(value.shape)
        if mask is not None and weight_mask is not None:
            mask = mask & weight_mask
        elif mask is None:
            mask = weight_mask
        return torch.where(mask, value, 0), torch.where(mask, weight, 0)


def _any_negative(tensor: torch.Tensor) -> bool:
    if tensor.dim() == 0:
        return tensor.item() < 0
    return bool((tensor < 0).any())


class _ExtremumMetric(Metric):
    """`compute()`: the extremum; -inf (max) or +inf (min) when nothing was seen."""

    _op: ReduceOp
    batched = BatchedRule(lambda states, _: states["extremum"])

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        return (
            MetricExample("vector and 0-d", (torch.tensor([1.0, -2.0, 3.5]),), (torch.tensor(0.5),)),
            MetricExample("empty batch and Python float", (torch.tensor([]),), (1.5,)),
            MetricExample("ignore NaN", (torch.tensor([2.0, float("nan"), -1.0]),), nan_policy="ignore"),
        )

    def __init__(self, *, dtype: torch.dtype = DEFAULT_STATE_DTYPE, **options: Any) -> None:
        super().__init__(**options)
        start = float("-inf") if self._op is ReduceOp.MAX else float("inf")
        self.extremum = MetricAccumulator(start, self._op, dtype=dtype)

    def update(self, value: Any) -> None:
        """Fold the extremum of `value`; an empty tensor changes nothing."""
        value, mask = self._begin_update(value)
        if value.numel() == 0:
            return
        if mask is not None:
            value = torch.where(mask, value, self.extremum.initial)
        if value.dim():
            value = value.amax() if self._op is ReduceOp.MAX else value.amin()
        self.extremum.update(value)


class MaxMetric(_ExtremumMetric):
    """Largest value seen.

    Example:
        >>> metric = MaxMetric()
        >>> metric.update(torch.tensor([1.0, 3.5, -2.0]))
        >>> metric.compute().item()
        3.5
    """

    _op = ReduceOp.MAX


class MinMetric(_ExtremumMetric):
    """Smallest value seen.

    Example:
        >>> metric = MinMetric()
        >>> metric.update(torch.tensor([1.0, 3.5, -2.0]))
        >>> metric.compute().item()
        -2.0
    """

    _op = ReduceOp.MIN


class PerRankMetric(Metric):
    """A value per rank (e.g. step time, to spot stragglers): its mean, or with `kind="counter"` its
    sum (tokens per rank), which exporters report as each rank's running total.

    The state is a world-sized vector in which each rank adds to its own slot only (a NaN or Inf of
    one rank never reaches another's), so it rides in the SUM bucket and costs no extra collective.
    `compute()`: one value per rank; a gauge's mean is NaN for a rank that reported nothing, a
    counter's sum 0.

    Example:
        >>> metric = PerRankMetric(world_size=2, rank=1)
        >>> metric.update(torch.tensor([0.25, 0.75]))  # step times of rank 1
        >>> metric.compute().tolist()
        [nan, 0.5]
    """

    label_name = "rank"
    batched = BatchedRule(
        lambda states, counter: torch.where(counter, states["sums"], states["sums"] / states["counts"]),
        constant=lambda metric: metric._counter,
    )

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        return (
            MetricExample(
                "gauge, vector and 0-d",
                (torch.tensor([1.0, 2.0]),),
                (torch.tensor(6.0),),
                world_size=4,
                rank=1,
            ),
            MetricExample("counter", (torch.tensor([3.0, 4.0]),), (5,), world_size=2, rank=0, kind="counter"),
            MetricExample(
                "ignore NaN",
                (torch.tensor([1.0, float("nan"), 3.0]),),
                world_size=2,
                rank=1,
                nan_policy="ignore",
            ),
        )

    def __init__(
        self,
        world_size: int,
        rank: int,
        *,
        kind: MetricKind | str = MetricKind.GAUGE,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(kind=kind, **options)
        if self.kind is MetricKind.HISTOGRAM:
            raise ValueError(f"{self.display_name()}: kind must be 'gauge' or 'counter', got 'histogram'")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"{self.display_name()}: rank must be in [0, world_size), got rank={rank}, "
                f"world_size={world_size}"
            )
        self.world_size = world_size
        self.rank = rank
        self._counter = torch.tensor([self.kind is MetricKind.COUNTER])
        """Whether the slots are sums (else means), shaped to broadcast against them."""
        self.sums = MetricAccumulator(torch.zeros(world_size), ReduceOp.SUM, dtype=dtype)
        self.counts = MetricAccumulator(torch.zeros(world_size), ReduceOp.SUM, dtype=dtype)

    def update(self, value: Any) -> None:
        """Add every entry of `value` to this rank's slot (a counter's must not be negative)."""
        value, mask = self._begin_update(value)
        if mask is not None:
            value = torch.where(mask, value, 0)
        if self.kind is MetricKind.COUNTER and self._inspects_values(value) and _any_negative(value):
            raise ValueError(f"{self.display_name()}: a counter cannot decrease, got a negative value")
        # The sums first: the only update that can fail (a float value into an integer state dtype,
        # an integer state overflowing), and it fails before any state has changed.
        self.sums.add_at(self.rank, self._batch_sum(self.sums, value))
        self.counts.add_at(self.rank, value.numel() if mask is None else mask.sum())

    def update_total(self, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Add `count` values already summed to `total` (Python numbers, or 0-d tensors on the
        metric's device), e.g. host timings accumulated over a window; no checks, no reduction."""
        self.sums.add_at(self.rank, total)
        self.counts.add_at(self.rank, count)
