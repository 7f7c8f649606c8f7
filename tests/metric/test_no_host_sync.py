"""`update()` of every exported metric, in every input form it declares (`Metric.examples()`), never
syncs a device: checked without a GPU by `tests.hostsync.NoHostSync` on the "meta" device (the
metrics' device path).

nan_policy="error" is left out by design (no example declares it): it reads every value to raise on
NaN ("a host sync on accelerators", its docstring says). The CPU-only input checks (labels in range,
non-negative counters and weights, integer overflow) do not run on a device, so they are not seen here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.hostsync import HostSyncError, NoHostSync
from tests.metric.examples import EXAMPLES, PATHS, build, on_device, on_path

DEVICE = torch.device("meta")


def _on(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_update_never_syncs_the_device(
    cls: type[tt.Metric], example: tt.metric.MetricExample, path: str
) -> None:
    """Each update twice: every tensor on the device, then 0-d tensors left on the CPU (accepted on
    any device, e.g. a host-side count). Staged, the updates applied too (as `Telemetry.step()` does)."""
    metric = on_path(build(cls, example).to(DEVICE), path)
    calls = [on_device(args, DEVICE, keep_0d=keep) for args in example.updates for keep in (False, True)]
    with NoHostSync():
        for args in calls:
            metric.update(*args)
        for accumulator in metric.accumulators.values():
            accumulator.apply_staged()


@pytest.mark.parametrize(
    ("make", "args"),
    [
        (tt.SumMetric, (np.float32(2.5),)),
        (tt.SumMetric, (np.arange(4.0),)),
        (tt.WeightedMeanMetric, (np.arange(4.0), np.ones(4))),
    ],
    ids=["numpy scalar", "numpy array", "numpy value and weights"],
)
def test_numpy_inputs_never_sync_the_device(make: Callable[[], tt.Metric], args: tuple[Any, ...]) -> None:
    metric = make().to(DEVICE)
    with NoHostSync():
        metric.update(*args)


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
