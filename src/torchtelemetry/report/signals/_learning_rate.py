"""The learning rate at the end of each window (`step(learning_rate=)`), max over ranks."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric import MaxMetric, Metric, MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["LEARNING_RATE", "LearningRate"]

LEARNING_RATE = "train/learning_rate"


class LearningRate(Signal):
    """The last learning rate given in the window; not exported until given on the exporting rank."""

    name = "learning_rate"
    keywords = ("learning_rate",)

    def __init__(self, context: SignalContext) -> None:
        super().__init__(context)
        self.metric = MaxMetric(description="Learning rate at the end of the window").to(context.device)
        self._value: float | None = None
        self._seen = False

    def metrics(self) -> dict[str, Metric]:
        return {LEARNING_RATE: self.metric}

    def descriptors(self) -> list[MetricDescriptor]:
        return [MetricDescriptor(LEARNING_RATE, MetricKind.GAUGE, "", self.metric.description)]

    def check(self, keyword: str, value: Any) -> None:
        """A real number, or a 0-d CPU tensor of one (a device tensor would be read with a host sync)."""
        kind = type(value)
        if kind is float or kind is int:  # the common case, first
            return
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 and value.is_cpu and not (value.is_complex() or value.dtype is torch.bool):
                return
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            return
        shape = (
            f"a tensor of shape {tuple(value.shape)} on {value.device}"
            if isinstance(value, torch.Tensor)
            else ""
        )
        raise TypeError(
            f"{LEARNING_RATE}: step(learning_rate=) takes a number (or a 0-d CPU tensor), got "
            f"{shape or type(value).__name__}; nothing of this step was recorded"
        )

    def sample_inputs(self) -> dict[str, Any]:
        return {"learning_rate": 1e-3}

    def record(self, keyword: str, value: Any) -> None:
        self._seen = True
        self._value = float(value)

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self._value is not None:
            self.metric.extremum.update(self._value)

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        if not self._seen:
            window.pop(LEARNING_RATE, None)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen = bool(state.get("seen", self._seen))
