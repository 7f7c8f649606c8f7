"""Tokens and samples (counters), their rates, model TFLOP/s and MFU.

`step(tokens=, samples=)`: a tensor is added on the device (no host read), a number on the host
and handed over once per window. Counts are checked before anything of the step is recorded
(`check_count`). Per window: the count (a counter: the window's increment, which the publisher adds
up into the total every backend gets), the rate over the window's wall time, and with
`TelemetryConfig.flops_per_token` (or `flops_per_sample`) torchtitan's TFLOP/s and MFU per device
(`_flops.model_flops`). Not exported until fed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric import Metric, MetricKind, SumMetric
from torchtelemetry.report._flops import ModelFlops, model_flops
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["Count", "ModelFlopsSignal", "check_count"]

TFLOPS_PER_SECOND = "train/tflops_per_second"
MFU = "train/mfu"


class Count(Signal):
    """A counter fed by the `step()` keyword `keyword` (`train/<keyword>`), and its rate."""

    def __init__(
        self, context: SignalContext, keyword: str, unit: str, description: str, rate_description: str
    ) -> None:
        super().__init__(context)
        self.name = keyword
        self.keywords = (keyword,)
        self.path = f"train/{keyword}"
        self.rate = f"{self.path}_per_second"
        self.unit = unit
        self.rate_description = rate_description
        self.metric = SumMetric(kind="counter", unit=unit, description=description).to(context.device)
        self._host = 0.0
        self._seen = False

    def metrics(self) -> dict[str, Metric]:
        return {self.path: self.metric}

    def descriptors(self) -> list[MetricDescriptor]:
        return [
            MetricDescriptor(self.path, MetricKind.COUNTER, self.unit, self.metric.description),
            MetricDescriptor(self.rate, MetricKind.GAUGE, f"{self.unit}_per_second", self.rate_description),
        ]

    def check(self, keyword: str, value: Any) -> None:
        check_count(self.path, value)

    def sample_inputs(self) -> dict[str, Any]:
        return {self.keywords[0]: 64}

    def record(self, keyword: str, value: Any) -> None:
        self._seen = True
        if isinstance(value, torch.Tensor):
            self.metric.update(value)
        else:
            self._host += float(value)

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self._host:
            self.metric.total.update(self._host)
        self._host = 0.0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        if not self._seen:
            window.pop(self.path, None)
        elif timing.duration_s > 0 and self.path in window:
            window[self.rate] = float(window[self.path]) / timing.duration_s  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen = bool(state.get("seen", self._seen))


class ModelFlopsSignal(Signal):
    """`train/tflops_per_second` and `train/mfu` from the window's tokens (or samples); after the
    counts in a `SignalSet`, as it reads their window values."""

    name = "model_flops"

    def __init__(self, context: SignalContext, flops: ModelFlops) -> None:
        super().__init__(context)
        self.flops = flops
        self.work = "train/samples" if flops.per_sample else "train/tokens"

    def descriptors(self) -> list[MetricDescriptor]:
        out = [
            MetricDescriptor(
                TFLOPS_PER_SECOND, unit="tflops_per_second", description="Model TFLOP/s achieved per device"
            )
        ]
        if self.flops.peak is not None:
            out.append(
                MetricDescriptor(MFU, unit="percent", description="Model FLOPs utilization per device (PaLM)")
            )
        return out

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        work = window.get(self.work)
        if timing.duration_s > 0 and work is not None:
            computed = model_flops(
                float(work),  # type: ignore[arg-type]
                timing.duration_s,
                self.context.world_size,
                self.flops.per_unit,
                self.flops.peak,
            )
            window.update({f"train/{name}": value for name, value in computed.items()})


def check_count(name: str, value: Any) -> None:
    """A count of tokens or samples is a finite number >= 0, as a counter of the user's refuses less.

    Tensors are read on the CPU only (on an accelerator the check would cost a host sync per step),
    as `SumMetric(kind="counter")` does.
    """
    kind = type(value)
    if (kind is int or kind is float) and math.isfinite(value) and value >= 0:  # the common case, first
        return
    keyword = name.rsplit("/", 1)[1]
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: step({keyword}=) must hold real counts, got a {value.dtype} tensor")
        if not value.is_cpu:
            return
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        if finite and not bool((value < 0).any()):
            return
        shown: Any = value.tolist() if value.numel() <= 4 else f"a tensor of {value.numel()} holding that"
    elif isinstance(value, numbers.Real):
        if math.isfinite(value) and value >= 0:
            return
        shown = value
    else:
        raise TypeError(f"{name}: step({keyword}=) must be a number or a tensor, got {type(value).__name__}")
    raise ValueError(
        f"{name}: step({keyword}={shown}) is not a count: a counter takes finite numbers >= 0 "
        "(a negative or NaN one would make the running total go back or stay NaN for the rest of the "
        "run); nothing of this step was recorded"
    )
