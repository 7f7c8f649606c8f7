"""Built-in training signals: step time per rank, tokens, samples, throughput, LR, peak memory.

Per-step inputs are accumulated on the host (Python floats, no device work) and
handed to device-resident metrics once per window, so leaving them on costs
nothing per step and no extra collective: they ride in the same buckets as the
user's metrics.
"""

from __future__ import annotations

import math
import resource
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchtelemetry.metric import MaxMetric, MetricKind, PerRankMetric, SumMetric
from torchtelemetry.report._values import MetricDescriptor, ScalarValue

__all__ = ["TrainingSignals", "WindowTiming"]

STEP_TIME = "train/step_time"
TOKENS = "train/tokens"
SAMPLES = "train/samples"
TOKENS_PER_SECOND = "train/tokens_per_second"
SAMPLES_PER_SECOND = "train/samples_per_second"
LEARNING_RATE = "train/learning_rate"
PEAK_MEMORY = "train/peak_memory"


@dataclass(frozen=True, slots=True)
class WindowTiming:
    """Host wall-clock facts of one collection window."""

    step: int
    """Last training step in the window."""
    timestamp: float
    """Unix time at which the window was scheduled."""
    duration_s: float
    """Host time from the previous window's schedule to this one's."""


class TrainingSignals:
    """Metrics and host accumulators for the built-in signals of one rank."""

    def __init__(self, *, world_size: int, rank: int, device: torch.device, max_rank_series: int) -> None:
        self.world_size = world_size
        self.device = device
        self.per_rank_series = world_size <= max_rank_series
        self.step_time = PerRankMetric(
            world_size, rank, unit="seconds", description="Mean host wall time of a training step, per rank"
        )
        self.tokens = SumMetric(kind="counter", unit="tokens", description="Tokens trained on")
        self.samples = SumMetric(kind="counter", unit="samples", description="Samples trained on")
        self.learning_rate = MaxMetric(description="Learning rate at the end of the window")
        self.peak_memory = MaxMetric(
            unit="bytes", description="Peak device memory allocated (CUDA), else peak resident memory"
        )
        self.metrics = {
            "train": {
                "step_time": self.step_time,
                "tokens": self.tokens,
                "samples": self.samples,
                "learning_rate": self.learning_rate,
                "peak_memory": self.peak_memory,
            }
        }
        for metric in (self.step_time, self.tokens, self.samples, self.learning_rate, self.peak_memory):
            metric.to(device)
        self._step_times: list[float] = []
        self._host_counts = {TOKENS: 0.0, SAMPLES: 0.0}
        self._seen: set[str] = set()
        self._learning_rate: float | None = None

    # -- per step (host only) ------------------------------------------------------------

    def record_step_time(self, seconds: float) -> None:
        self._step_times.append(seconds)

    def record_tokens(self, value: torch.Tensor | float | int) -> None:
        """Count tokens: tensors are added on the device, numbers on the host."""
        self._record_count(TOKENS, self.tokens, value)

    def record_samples(self, value: torch.Tensor | float | int) -> None:
        """Count samples: tensors are added on the device, numbers on the host."""
        self._record_count(SAMPLES, self.samples, value)

    def _record_count(self, name: str, metric: SumMetric, value: torch.Tensor | float | int) -> None:
        self._seen.add(name)
        if isinstance(value, torch.Tensor):
            metric.update(value)
        else:
            self._host_counts[name] += float(value)

    def record_learning_rate(self, value: float) -> None:
        self._seen.add(LEARNING_RATE)
        self._learning_rate = float(value)

    # -- per window ----------------------------------------------------------------------

    def flush_to_device(self) -> None:
        """Hand the host accumulators to the metrics: one small host-to-device copy per window.

        The values are the signals' own, already checked on the host, so they go straight
        into the accumulators.
        """
        learning_rate = float("-inf") if self._learning_rate is None else self._learning_rate
        values = _to_device(
            [
                sum(self._step_times),
                len(self._step_times),
                self._host_counts[TOKENS],
                self._host_counts[SAMPLES],
                _peak_memory(self.device),
                learning_rate,
            ],
            self.device,
        )
        self.step_time.update_total(values[0], values[1])
        self.tokens.total.update(values[2])
        self.samples.total.update(values[3])
        self.peak_memory.extremum.update(values[4])
        self.learning_rate.extremum.update(values[5])
        self._step_times = []
        self._host_counts = {TOKENS: 0.0, SAMPLES: 0.0}

    def descriptors(self, described: list[MetricDescriptor]) -> list[MetricDescriptor]:
        """`described` (from the metrics) adjusted for what `publish` emits, plus throughput."""
        out = []
        for descriptor in described:
            if descriptor.name == STEP_TIME and not self.per_rank_series:
                out.extend(
                    MetricDescriptor(f"{STEP_TIME}/{stat}", MetricKind.GAUGE, "seconds", f"{stat} over ranks")
                    for stat in ("min", "median", "max")
                )
            else:
                out.append(descriptor)
        out.append(
            MetricDescriptor(TOKENS_PER_SECOND, MetricKind.GAUGE, "tokens_per_second", "Token throughput")
        )
        out.append(
            MetricDescriptor(SAMPLES_PER_SECOND, MetricKind.GAUGE, "samples_per_second", "Sample throughput")
        )
        return out

    def publish(self, window: dict[str, ScalarValue], timing: WindowTiming) -> None:
        """Turn one window's signal values into what is exported (in place): throughput,
        min/median/max step time above the per-rank series limit, and nothing for unfed signals."""
        for name in (TOKENS, SAMPLES):
            if name not in self._seen:
                window.pop(name, None)
        if LEARNING_RATE not in self._seen:
            window.pop(LEARNING_RATE, None)
        if timing.duration_s > 0:
            if TOKENS in window:
                window[TOKENS_PER_SECOND] = float(window[TOKENS]) / timing.duration_s  # type: ignore[arg-type]
            if SAMPLES in window:
                window[SAMPLES_PER_SECOND] = float(window[SAMPLES]) / timing.duration_s  # type: ignore[arg-type]
        step_times = window.get(STEP_TIME)
        if isinstance(step_times, Mapping):
            finite = {rank: value for rank, value in step_times.items() if math.isfinite(value)}
            if self.per_rank_series:
                window[STEP_TIME] = finite
            else:
                del window[STEP_TIME]
                if finite:
                    values = list(finite.values())
                    window[f"{STEP_TIME}/min"] = min(values)
                    window[f"{STEP_TIME}/median"] = statistics.median(values)
                    window[f"{STEP_TIME}/max"] = max(values)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": sorted(self._seen)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen = set(state.get("seen", ()))


def _to_device(values: list[float], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.float64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
