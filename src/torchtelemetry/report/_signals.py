"""Built-in training signals: step time and data wait per rank, tokens, samples, throughput, model
FLOPs utilization, learning rate, memory.

Per-step inputs are accumulated on the host (Python floats, no device work) and
handed to device-resident metrics once per window, so leaving them on costs
nothing per step and no extra collective: they ride in the same buckets as the
user's metrics. Per-rank values are world-sized vectors in the SUM bucket, so the
ranks holding the fastest and slowest step time (`train/step_time/min_rank`, `max_rank`, exported
whatever the world size) are known on every rank for free. Above `max_rank_series` ranks every
value per rank is exported as statistics over ranks (`RankSeriesLimit`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric import MaxMetric, MetricKind, PerRankMetric, SumMetric, metric_leaves
from torchtelemetry.report._flops import ModelFlops, model_flops
from torchtelemetry.report._memory import AllocatorStats, allocator_metrics, peak_memory
from torchtelemetry.report._ranks import RankSeriesLimit
from torchtelemetry.report._values import MetricDescriptor, ScalarValue
from torchtelemetry.report.signals import SignalSet, WindowTiming, health_descriptors

__all__ = ["TrainingSignals", "WindowTiming", "signal_descriptors"]

STEP_TIME = "train/step_time"
DATA_WAIT = "train/data_wait"
DATA_WAIT_SHARE = "train/data_wait_share"
TOKENS = "train/tokens"
SAMPLES = "train/samples"
TOKENS_PER_SECOND = "train/tokens_per_second"
SAMPLES_PER_SECOND = "train/samples_per_second"
TFLOPS_PER_SECOND = "train/tflops_per_second"
MFU = "train/mfu"
LEARNING_RATE = "train/learning_rate"
PEAK_MEMORY = "train/peak_memory"


class TrainingSignals:
    """Metrics and host accumulators for the built-in signals of one rank."""

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        device: torch.device,
        flops: ModelFlops | None = None,
        health: SignalSet | None = None,
    ) -> None:
        self.world_size = world_size
        self.health = health
        self.device = device
        self.flops = flops

        def per_rank(unit: str, description: str) -> PerRankMetric:
            return PerRankMetric(world_size, rank, unit=unit, description=description)

        self.step_time = per_rank("seconds", "Mean host wall time of a training step, per rank")
        self.data_wait = per_rank("seconds", "Mean time per step spent waiting for the next batch, per rank")
        self.data_wait_share = per_rank(
            "percent", "Share of the window's wall time spent waiting for data, per rank"
        )
        self.tokens = SumMetric(kind="counter", unit="tokens", description="Tokens trained on")
        self.samples = SumMetric(kind="counter", unit="samples", description="Samples trained on")
        self.learning_rate = MaxMetric(description="Learning rate at the end of the window")
        self.peak_memory = MaxMetric(
            unit="bytes", description="Peak device memory allocated (CUDA), else peak resident memory"
        )
        train: dict[str, Any] = {
            "step_time": self.step_time,
            "data_wait": self.data_wait,
            "data_wait_share": self.data_wait_share,
            "tokens": self.tokens,
            "samples": self.samples,
            "learning_rate": self.learning_rate,
            "peak_memory": self.peak_memory,
        }
        self._allocator = AllocatorStats(device) if device.type == "cuda" else None
        if self._allocator is not None:
            self.memory = allocator_metrics()
            train["memory"] = self.memory
        self.metrics: dict[str, Any] = {"train": train}
        self._health_paths = tuple(health.metrics()) if health is not None else ()
        for path, metric in (health.metrics() if health is not None else {}).items():
            self.metrics[path] = metric
        for metric in metric_leaves(self.metrics, op="TrainingSignals"):
            metric[1].to(device)
        self._step_times: list[float] = []
        self._data_wait = 0.0
        self._steps = 0
        self._host_counts = {TOKENS: 0.0, SAMPLES: 0.0}
        self._seen: set[str] = set()
        self._learning_rate: float | None = None

    # -- per step (host only) ------------------------------------------------------------

    def record_step(
        self,
        step_time: float | None,
        *,
        tokens: torch.Tensor | float | None = None,
        samples: torch.Tensor | float | None = None,
        learning_rate: float | None = None,
        data_time: float | None = None,
    ) -> None:
        """One step ended (`step_time` is None for the first: no previous step to time from), with
        what `Telemetry.step()` was given. Every input is checked before anything is recorded: a
        bad one raises naming its signal and leaves the step unrecorded."""
        if data_time is not None:
            _check_seconds(data_time)
        counts = [(name, n) for name, n in ((TOKENS, tokens), (SAMPLES, samples)) if n is not None]
        for name, value in counts:
            _check_count(name, value)
        if data_time is not None:
            self.record_data_wait(data_time)
        self._steps += 1
        if step_time is not None:
            self._step_times.append(step_time)
        for name, value in counts:
            self._seen.add(name)
            if isinstance(value, torch.Tensor):
                metric = self.tokens if name == TOKENS else self.samples
                metric.update(value)
            else:
                self._host_counts[name] += float(value)
        if learning_rate is not None:
            self._seen.add(LEARNING_RATE)
            self._learning_rate = float(learning_rate)

    def record_data_wait(self, seconds: float) -> None:
        """Time spent waiting for the next batch during the current step (added up within a step)."""
        _check_seconds(seconds)
        self._seen.add(DATA_WAIT)
        self._data_wait += float(seconds)

    # -- per window ----------------------------------------------------------------------

    def flush_to_device(self, duration_s: float, *, final: bool = False) -> None:
        """Hand the host accumulators to the metrics, as Python numbers in the kernels' arguments:
        no host-to-device copy, no pinned allocation, no sync.

        `duration_s` is this rank's host time since the previous flush; the data-wait share is
        the waits over the durations, so a flush in mid-window (a checkpoint) changes nothing.
        The values are the signals' own, already checked on the host, so they go straight into
        the accumulators. `final` (a checkpoint, close) waits, bounded, for device-timed phases.
        """
        if self.health is not None:
            self.health.flush(duration_s, final=final)
        self.step_time.update_total(sum(self._step_times), len(self._step_times))
        self.data_wait.update_total(self._data_wait, self._steps)
        self.data_wait_share.update_total(100 * self._data_wait, duration_s)
        self.tokens.total.update(self._host_counts[TOKENS])
        self.samples.total.update(self._host_counts[SAMPLES])
        self.peak_memory.extremum.update(peak_memory(self.device))
        learning_rate = float("-inf") if self._learning_rate is None else self._learning_rate
        self.learning_rate.extremum.update(learning_rate)
        if self._allocator is not None:
            max_active, max_reserved, retries, ooms = self._allocator.read()
            self.memory["max_active"].extremum.update(max_active)
            self.memory["max_reserved"].extremum.update(max_reserved)
            self.memory["alloc_retries"].total.update(retries)
            self.memory["ooms"].total.update(ooms)
        self._step_times = []
        self._data_wait = 0.0
        self._steps = 0
        self._host_counts = {TOKENS: 0.0, SAMPLES: 0.0}

    def descriptors(self, described: list[MetricDescriptor]) -> list[MetricDescriptor]:
        """`described` (from the metrics) with what `publish` adds: the ranks of the extreme step
        times and the derived signals (values per rank above the limit are `RankSeriesLimit`'s)."""
        out = []
        for descriptor in described:
            if any(
                descriptor.name.startswith(f"{path}/") or descriptor.name == path
                for path in self._health_paths
            ):
                continue  # a health signal's raw window state: it describes what it derives itself
            out.append(descriptor)
            if descriptor.name == STEP_TIME:
                out.extend(
                    MetricDescriptor(
                        f"{STEP_TIME}/{stat}_rank", description=f"Rank with the {stat} step time"
                    )
                    for stat in ("min", "max")
                )
        out.append(
            MetricDescriptor(TOKENS_PER_SECOND, MetricKind.GAUGE, "tokens_per_second", "Token throughput")
        )
        out.append(
            MetricDescriptor(SAMPLES_PER_SECOND, MetricKind.GAUGE, "samples_per_second", "Sample throughput")
        )
        if self.flops is not None:
            out.append(
                MetricDescriptor(
                    TFLOPS_PER_SECOND,
                    unit="tflops_per_second",
                    description="Model TFLOP/s achieved per device",
                )
            )
            if self.flops.peak is not None:
                out.append(
                    MetricDescriptor(
                        MFU, unit="percent", description="Model FLOPs utilization per device (PaLM)"
                    )
                )
        if self.health is not None:
            out.extend(self.health.descriptors())
        return out

    def publish(self, window: dict[str, ScalarValue], timing: WindowTiming) -> None:
        """Turn one window's signal values into what is exported (in place): throughput, model
        FLOPs, the extreme step times' ranks, nothing for unfed signals (values per rank above the
        limit are `RankSeriesLimit`'s)."""
        for name in (TOKENS, SAMPLES, LEARNING_RATE):
            if name not in self._seen:
                window.pop(name, None)
        if DATA_WAIT not in self._seen:
            window.pop(DATA_WAIT, None)
            window.pop(DATA_WAIT_SHARE, None)
        if self.health is not None:  # before values per rank are reduced: phases read the data wait
            self.health.derive(window, timing)
        if timing.duration_s > 0:
            if TOKENS in window:
                window[TOKENS_PER_SECOND] = float(window[TOKENS]) / timing.duration_s  # type: ignore[arg-type]
            if SAMPLES in window:
                window[SAMPLES_PER_SECOND] = float(window[SAMPLES]) / timing.duration_s  # type: ignore[arg-type]
            work = window.get(SAMPLES if self.flops and self.flops.per_sample else TOKENS)
            if self.flops is not None and work is not None:
                computed = model_flops(
                    float(work),
                    timing.duration_s,
                    self.world_size,
                    self.flops.per_unit,
                    self.flops.peak,  # type: ignore[arg-type]
                )
                window.update({f"train/{name}": value for name, value in computed.items()})
        step_times = window.get(STEP_TIME)
        if isinstance(step_times, Mapping):  # lowest rank on ties
            finite = {rank: value for rank, value in step_times.items() if math.isfinite(value)}
            if finite:
                window[f"{STEP_TIME}/min_rank"] = float(
                    min(finite, key=lambda rank: (finite[rank], int(rank)))
                )
                window[f"{STEP_TIME}/max_rank"] = float(
                    max(finite, key=lambda rank: (finite[rank], -int(rank)))
                )

    def state_dict(self) -> dict[str, Any]:
        health = self.health.state_dict() if self.health is not None else {}
        return {"seen": sorted(self._seen), "health": health}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen = set(state.get("seen", ()))
        if self.health is not None:
            self.health.load_state_dict(state.get("health", {}))


def signal_descriptors() -> list[MetricDescriptor]:
    """Every name the built-in signals can export, in every shape: one series per rank and
    min/median/max over ranks, model FLOPs with MFU, the CUDA allocator's detail, the health
    signals (for dashboards and alert rules that must know them all)."""
    from torchtelemetry.report._flatten import describe_metrics

    found: dict[str, MetricDescriptor] = {}
    signals = TrainingSignals(
        world_size=1,
        rank=0,
        device=torch.device("cpu"),
        flops=ModelFlops(per_unit=1.0, per_sample=False, peak=1.0),
    )
    signals.metrics["train"]["memory"] = allocator_metrics()
    described = signals.descriptors(describe_metrics(signals.metrics))
    for max_rank_series in (1, 0):
        found.update((d.name, d) for d in RankSeriesLimit(1, max_rank_series).describe(described))
    found.update((d.name, d) for d in health_descriptors())
    return list(found.values())


def _check_seconds(seconds: Any) -> None:
    if isinstance(seconds, torch.Tensor) or not isinstance(seconds, int | float):
        kind = type(seconds).__name__
        raise TypeError(f"{DATA_WAIT}: data wait must be host seconds (a float), got {kind}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{DATA_WAIT}: data wait must be a finite number of seconds >= 0, got {seconds}")


def _check_count(name: str, value: Any) -> None:
    """A count of tokens or samples is a finite number >= 0, as a counter of the user's refuses less.

    Tensors are read on the CPU only (on an accelerator the check would cost a host sync per step),
    as `SumMetric(kind="counter")` does.
    """
    keyword = name.rsplit("/", 1)[1]
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: step({keyword}=) must hold real counts, got a {value.dtype} tensor")
        if not value.is_cpu:
            return
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        if finite and not bool((value < 0).any()):
            return
        shown = value.tolist() if value.numel() <= 4 else f"a tensor of {value.numel()} holding that"
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
