"""Built-in training signals, one small object each (`Signal`), routed by a `SignalSet`.

Health signals: phases and straggler scores, the non-finite sentinel and spike scores, memory
health, goodput and GPU health (NVML). See docs/signals.md for every name, unit and cost.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from torchtelemetry.metric import Metric, SumMetric
from torchtelemetry.report._values import MetricDescriptor
from torchtelemetry.report.signals._base import (
    RankValues,
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)
from torchtelemetry.report.signals._builtin import builtin_descriptors, builtin_signals
from torchtelemetry.report.signals._clock import EventClock, HostClock, HostTimer, PhaseClock, PhaseTimer
from torchtelemetry.report.signals._goodput import Goodput
from torchtelemetry.report.signals._memory_health import MemoryHealth, memory_descriptors, resident_bytes
from torchtelemetry.report.signals._nonfinite import CountingUpdate, NonFiniteSentinel, watched_metrics
from torchtelemetry.report.signals._nvml import (
    THROTTLE_REASONS,
    GpuHealth,
    NvmlReader,
    gpu_descriptors,
    open_nvml,
)
from torchtelemetry.report.signals._phases import DATA_PHASE, DEFAULT_PHASES, Phases, check_phase_names
from torchtelemetry.report.signals._set import SignalSet
from torchtelemetry.report.signals._spikes import MIN_HISTORY, Spikes
from torchtelemetry.report.signals._stragglers import MIN_SHARE, StragglerScores

__all__ = [
    "DATA_PHASE",
    "DEFAULT_PHASES",
    "MIN_HISTORY",
    "MIN_SHARE",
    "THROTTLE_REASONS",
    "CountingUpdate",
    "EventClock",
    "GpuHealth",
    "Goodput",
    "HostClock",
    "HostTimer",
    "MemoryHealth",
    "NonFiniteSentinel",
    "NvmlReader",
    "PhaseClock",
    "PhaseTimer",
    "Phases",
    "RankValues",
    "Signal",
    "SignalContext",
    "SignalSet",
    "Spikes",
    "StragglerScores",
    "WindowTiming",
    "builtin_descriptors",
    "builtin_signals",
    "check_phase_names",
    "finite_by_rank",
    "gpu_descriptors",
    "health_descriptors",
    "health_signals",
    "highest_rank",
    "lowest_rank",
    "memory_descriptors",
    "open_nvml",
    "resident_bytes",
    "watched_metrics",
]


def health_signals(
    context: SignalContext,
    *,
    leaves: Sequence[tuple[str, Metric]],
    phases: Sequence[str],
    straggler_top_k: int,
    nonfinite: Sequence[str] | None,
    spike_sigma: float,
    spike_windows: int,
    run_id: str,
    progress_file: str | os.PathLike[str] | None,
    nvml: bool,
) -> list[Signal]:
    """The health signals of one `Telemetry` (its `TelemetryConfig` fields of the same names)."""
    watched = watched_metrics(leaves, nonfinite)
    signals: list[Signal] = [
        Phases(context, phases, top_k=straggler_top_k),
        NonFiniteSentinel(context, watched),
        Spikes(context, tuple(watched), sigma=spike_sigma, windows=spike_windows),
        MemoryHealth(context),
        Goodput(context, run_id=run_id, progress_file=progress_file),
    ]
    reader = open_nvml(context.device) if nvml and context.device.type == "cuda" else None
    if reader is not None:
        signals.append(GpuHealth(context, reader))
    return signals


def health_descriptors() -> list[MetricDescriptor]:
    """Every name the health signals can export, in every shape (on CUDA, with NVML, the default
    phases per rank, a watched metric), for dashboards and alert rules that must know them all."""
    context = SignalContext(world_size=1, rank=0, device=torch.device("cpu"))
    watched = {"loss": SumMetric()}
    signals = [
        Phases(context, DEFAULT_PHASES),
        NonFiniteSentinel(context, watched),
        Spikes(context, tuple(watched), sigma=6.0, windows=MIN_HISTORY),
        Goodput(context, run_id="", progress_file=None),
    ]
    described = [descriptor for signal in signals for descriptor in signal.descriptors()]
    for signal in signals:
        signal.close()
    return described + memory_descriptors(cuda=True) + gpu_descriptors()
