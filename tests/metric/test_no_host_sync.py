"""`update()` of every built-in metric, in every documented input form, never syncs a device: checked
without a GPU by `tests.hostsync.NoHostSync` on the "meta" device (the metrics' device path).

nan_policy="error" is left out by design: it reads every value to raise on NaN ("a host sync on
accelerators", its docstring says). The CPU-only input checks (labels in range, non-negative
counters and weights, integer overflow) do not run on a device, so they are not seen here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.hostsync import HostSyncError, NoHostSync

DEVICE = torch.device("meta")


def _on(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def _labels(*shape: int) -> torch.Tensor:
    return _on(*shape, dtype=torch.int64)


# (metric factory, the inputs of one update() call) for every documented input form.
CASES: dict[str, tuple[Callable[[], tt.Metric], Callable[[], tuple[Any, ...]]]] = {
    "sum, vector": (tt.SumMetric, lambda: (_on(16),)),
    "sum, 0-d": (tt.SumMetric, lambda: (_on(),)),
    "sum, float16 batch": (tt.SumMetric, lambda: (_on(1024, dtype=torch.float16),)),
    "sum, Python int": (tt.SumMetric, lambda: (512,)),
    "sum, Python float": (tt.SumMetric, lambda: (0.5,)),
    "sum, 0-d CPU tensor": (tt.SumMetric, lambda: (torch.tensor(3.0),)),
    "sum, numpy scalar": (tt.SumMetric, lambda: (np.float32(2.5),)),
    "sum, numpy array": (tt.SumMetric, lambda: (np.arange(4.0),)),
    "sum, ignore NaN": (lambda: tt.SumMetric(nan_policy="ignore"), lambda: (_on(8),)),
    "counter, 0-d int": (lambda: tt.SumMetric(kind="counter"), lambda: (_labels(),)),
    "counter, int64 state": (lambda: tt.SumMetric(kind="counter", dtype=torch.int64), lambda: (_labels(8),)),
    "weighted mean, 0-d and tokens": (tt.WeightedMeanMetric, lambda: (_on(), 4096)),
    "weighted mean, 0-d and 0-d tensor": (tt.WeightedMeanMetric, lambda: (_on(), _labels())),
    "weighted mean, default weight": (tt.WeightedMeanMetric, lambda: (_on(),)),
    "weighted mean, vector and weights": (tt.WeightedMeanMetric, lambda: (_on(16), _on(16))),
    "weighted mean, vector and scalar": (tt.WeightedMeanMetric, lambda: (_on(16), 2.0)),
    "weighted mean, ignore NaN": (
        lambda: tt.WeightedMeanMetric(nan_policy="ignore"),
        lambda: (_on(16), _on(16)),
    ),
    "weighted mean, float32 state": (lambda: tt.WeightedMeanMetric(dtype=torch.float32), lambda: (_on(), 3)),
    "max, vector": (tt.MaxMetric, lambda: (_on(16),)),
    "max, empty": (tt.MaxMetric, lambda: (_on(0),)),
    "max, Python float": (tt.MaxMetric, lambda: (1.5,)),
    "min, vector, ignore NaN": (lambda: tt.MinMetric(nan_policy="ignore"), lambda: (_on(16),)),
    "per rank, 0-d": (lambda: tt.PerRankMetric(4, 1), lambda: (_on(),)),
    "per rank, vector, ignore NaN": (lambda: tt.PerRankMetric(4, 1, nan_policy="ignore"), lambda: (_on(8),)),
    "accuracy, logits": (tt.AccuracyMetric, lambda: (_on(32, 10), _labels(32))),
    "accuracy, top-3 logits": (lambda: tt.AccuracyMetric(top_k=3), lambda: (_on(32, 10), _labels(32))),
    "accuracy, sequence logits": (tt.AccuracyMetric, lambda: (_on(4, 8, 10), _labels(4, 8))),
    "accuracy, labels": (lambda: tt.AccuracyMetric(num_classes=10), lambda: (_labels(32), _labels(32))),
    "accuracy, ignore_index": (
        lambda: tt.AccuracyMetric(ignore_index=-100),
        lambda: (_on(32, 10), _labels(32)),
    ),
    "accuracy, ignore NaN logits": (
        lambda: tt.AccuracyMetric(nan_policy="ignore"),
        lambda: (_on(32, 10), _labels(32)),
    ),
    "confusion, logits": (lambda: tt.ConfusionMatrixMetric(10), lambda: (_on(32, 10), _labels(32))),
    "confusion, labels": (lambda: tt.ConfusionMatrixMetric(10), lambda: (_labels(32), _labels(32))),
    "confusion, ignore_index": (
        lambda: tt.ConfusionMatrixMetric(10, ignore_index=-100),
        lambda: (_labels(32), _labels(32)),
    ),
    "auroc, probabilities": (tt.BinaryAUROCMetric, lambda: (_on(32), _labels(32))),
    "auroc, logits and bool target": (
        lambda: tt.BinaryAUROCMetric(from_logits=True),
        lambda: (_on(32), _on(32, dtype=torch.bool)),
    ),
    "histogram, 0-d": (lambda: tt.HistogramMetric(bins=[0.1, 1, 10]), lambda: (_on(),)),
    "histogram, float16 batch": (
        lambda: tt.HistogramMetric(bins=[0.1, 1, 10]),
        lambda: (_on(64, dtype=torch.float16),),
    ),
    "histogram, integers": (lambda: tt.HistogramMetric(bins=[1, 10]), lambda: (_labels(64),)),
    "histogram, ignore NaN": (lambda: tt.HistogramMetric(bins=[1.0], nan_policy="ignore"), lambda: (_on(8),)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_never_syncs_the_device(case: str) -> None:
    factory, inputs = CASES[case]
    metric = factory().to(DEVICE)
    arguments = inputs()
    with NoHostSync():
        metric.update(*arguments)
        metric.update(*arguments)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("value", [2.5, 7, torch.tensor(1.0)], ids=["float", "int", "0-d CPU tensor"])
def test_accumulator_update_of_a_host_number_never_syncs_the_device(op: str, value: Any) -> None:
    accumulator = tt.MetricAccumulator(0.0, op).to(DEVICE)
    with NoHostSync():
        accumulator.update(value)
        accumulator.update(_on(dtype=torch.float64))


SYNCS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x.sum() > 0),
    "float": lambda x: float(x.sum()),
    "tolist": lambda x: x.tolist(),
    "format": lambda x: f"{x}",
    "cpu": lambda x: x.cpu(),
    "to cpu": lambda x: x.to("cpu"),
    "nonzero": lambda x: x.nonzero(),
    "boolean mask": lambda x: x[x > 0],
    "masked_select": lambda x: x.masked_select(x > 0),
    "unique": lambda x: torch.unique(x),
    "equal": lambda x: torch.equal(x, x),
    "repeat_interleave": lambda x: torch.repeat_interleave(x.long()),
    "blocking host-to-device copy": lambda x: torch.ones(3).to(x.device),
    "tensor of host data": lambda x: torch.tensor([1.0, 2.0], device=x.device),
    "as_tensor of a Python number": lambda x: torch.as_tensor(2.0, device=x.device),
}


@pytest.mark.parametrize("sync", list(SYNCS))
def test_the_detector_sees_every_kind_of_host_sync(sync: str) -> None:
    with pytest.raises(HostSyncError, match="host sync: "), NoHostSync():
        SYNCS[sync](_on(3))


def test_the_detector_allows_what_does_not_sync() -> None:
    with NoHostSync():
        values = _on(3)
        torch.full((), 2.0, device=DEVICE)
        torch.ones(3).to(DEVICE, non_blocking=True)
        (values * 2).sum().add_(1)
        torch.where(values > 0, values, 0)
