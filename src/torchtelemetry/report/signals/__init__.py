"""Built-in training signals, one small object each (`Signal`), routed by a `SignalSet`.

Health signals: phases and straggler scores, the non-finite sentinel and spike scores, memory
health, goodput and GPU health (NVML). See docs/signals.md for every name, unit and cost.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torchtelemetry.metric import Metric
from torchtelemetry.report.signals._base import (
    RankValues,
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)
from torchtelemetry.report.signals._clock import EventClock, HostClock, PhaseClock, PhaseTimer
from torchtelemetry.report.signals._goodput import Goodput
from torchtelemetry.report.signals._memory_health import MemoryHealth, resident_bytes
from torchtelemetry.report.signals._nonfinite import CountingUpdate, NonFiniteSentinel, watched_metrics
from torchtelemetry.report.signals._nvml import THROTTLE_REASONS, GpuHealth, NvmlReader, open_nvml
from torchtelemetry.report.signals._phases import DATA_PHASE, Phases, check_phase_names
from torchtelemetry.report.signals._set import SignalSet
from torchtelemetry.report.signals._spikes import MIN_HISTORY, Spikes
from torchtelemetry.report.signals._stragglers import MIN_SHARE, StragglerScores

__all__ = [
    "DATA_PHASE",
    "MIN_HISTORY",
    "MIN_SHARE",
    "THROTTLE_REASONS",
    "CountingUpdate",
    "EventClock",
    "GpuHealth",
    "Goodput",
    "HostClock",
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
    "check_phase_names",
    "finite_by_rank",
    "health_signals",
    "highest_rank",
    "lowest_rank",
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
