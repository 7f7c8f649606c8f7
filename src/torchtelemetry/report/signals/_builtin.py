"""The built-in signals of one `Telemetry`, in derive order, and every name they can export."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchtelemetry.metric import Metric, SumMetric
from torchtelemetry.report._flops import ModelFlops
from torchtelemetry.report._memory import AllocatorStats
from torchtelemetry.report._ranks import RankSeriesLimit
from torchtelemetry.report._values import MetricDescriptor
from torchtelemetry.report.signals._base import Signal, SignalContext
from torchtelemetry.report.signals._captures import CAPTURE_DESCRIPTORS, Captures, CaptureSource
from torchtelemetry.report.signals._data_wait import DataWait
from torchtelemetry.report.signals._goodput import Goodput, GoodputSource
from torchtelemetry.report.signals._hang import HANG_DESCRIPTORS
from torchtelemetry.report.signals._layers import DEFAULT_MAX_LAYER_SERIES, LayerStatistics
from torchtelemetry.report.signals._learning_rate import LearningRate
from torchtelemetry.report.signals._memory_health import MemoryHealth
from torchtelemetry.report.signals._nonfinite import NonFiniteSentinel, watched_metrics
from torchtelemetry.report.signals._nvml import GpuHealth, open_nvml
from torchtelemetry.report.signals._peak_memory import PeakMemory
from torchtelemetry.report.signals._phases import DEFAULT_PHASES, Phases
from torchtelemetry.report.signals._spikes import Spikes
from torchtelemetry.report.signals._step_time import StepTime
from torchtelemetry.report.signals._sync_wait import SyncWait
from torchtelemetry.report.signals._throughput import Count, ModelFlopsSignal
from torchtelemetry.report.signals._timeline import NO_SECTIONS, SectionLog
from torchtelemetry.report.signals._trace_sampling import TraceSampling, TraceSink

__all__ = [
    "DEFAULT_SPIKE_SIGMA",
    "DEFAULT_SPIKE_WINDOWS",
    "DEFAULT_TOP_K",
    "builtin_descriptors",
    "builtin_signals",
    "cuda_only_descriptors",
    "event_only_descriptors",
    "signal_descriptors",
]

DEFAULT_TOP_K = 3
"""`TelemetryConfig.straggler_top_k` by default."""
DEFAULT_SPIKE_SIGMA = 6.0
"""`TelemetryConfig.spike_sigma` by default (OLMo-core's)."""
DEFAULT_SPIKE_WINDOWS = 32
"""`TelemetryConfig.spike_windows` by default."""


def builtin_signals(
    context: SignalContext,
    *,
    leaves: Sequence[tuple[str, Metric]] = (),
    flops: ModelFlops | None = None,
    phases: Sequence[str] = DEFAULT_PHASES,
    straggler_top_k: int = DEFAULT_TOP_K,
    nonfinite: Sequence[str] | None = None,
    spike_sigma: float = DEFAULT_SPIKE_SIGMA,
    spike_windows: int = DEFAULT_SPIKE_WINDOWS,
    goodput: GoodputSource | None = None,
    nvml: bool = False,
    trace_ranks: int = 0,
    traces: TraceSink | None = None,
    timeline: SectionLog = NO_SECTIONS,
    captures: CaptureSource | None = None,
    every: int = 10,
    max_layer_series: int = DEFAULT_MAX_LAYER_SERIES,
) -> list[Signal]:
    """Every built-in signal of one `Telemetry` (its `TelemetryConfig` fields of the same names;
    `leaves` are the user's metrics, `flops` from `ModelFlops.resolve`, `goodput` the run's goodput
    state, without which goodput is only described; `traces` the run's traces, fed by `timeline`,
    whose kinds are `section_kinds(phases)`; `captures` the run's captures, none without), in the
    order they derive: a signal that reads another's window values comes after it (model FLOPs after
    the counts, the trace sampling and the phases after the data wait and the sync wait, the trace
    sampling before the phases, which drop their values per rank above `max_rank_series`, the
    captures last)."""
    watched = watched_metrics(leaves, nonfinite)
    # One reading of the CUDA allocator per window for every memory signal.
    allocator = AllocatorStats(context.device, background=True) if context.device.type == "cuda" else None
    signals: list[Signal] = [
        StepTime(context),
        DataWait(context, timeline),
        Count(context, "tokens", "tokens", "Tokens trained on", "Token throughput"),
        Count(context, "samples", "samples", "Samples trained on", "Sample throughput"),
        LearningRate(context),
        PeakMemory(context, allocator),
        SyncWait(context, timeline),
        *([TraceSampling(context, traces, trace_ranks)] if traces is not None and trace_ranks else []),
        Phases(context, phases, top_k=straggler_top_k, log=timeline),
        NonFiniteSentinel(context, watched),
        Spikes(context, tuple(watched), sigma=spike_sigma, windows=spike_windows),
        MemoryHealth(context, allocator),
        Goodput(context, goodput),
        LayerStatistics(context, every=every, max_layer_series=max_layer_series),
    ]
    if flops is not None:
        signals.insert(4, ModelFlopsSignal(context, flops))
    reader = open_nvml(context.device) if nvml and context.device.type == "cuda" else None
    signals.append(GpuHealth(context, reader))  # without a reader: nothing exported, no thread
    if captures is not None:
        signals.append(Captures(context, captures))
    return signals


def _described(max_rank_series: int) -> tuple[list[MetricDescriptor], list[type[Signal]]]:
    """The names and classes of the built-in signals as built on CPU with every option on."""
    context = SignalContext(world_size=1, rank=0, device=torch.device("cpu"), max_rank_series=max_rank_series)
    signals = builtin_signals(
        context, leaves=[("loss", SumMetric())], flops=ModelFlops(per_unit=1.0, per_sample=False, peak=1.0)
    )
    described = [descriptor for signal in signals for descriptor in signal.descriptors()]
    for signal in signals:
        signal.close()
    return described, [type(signal) for signal in signals]


def _cuda_only(classes: Sequence[type[Signal]]) -> list[MetricDescriptor]:
    """Each of `classes`' own `cuda_descriptors()`, once by name."""
    return list({d.name: d for cls in classes for d in cls.cuda_descriptors()}.values())


def cuda_only_descriptors() -> list[MetricDescriptor]:
    """The names the built-in signals export only on CUDA: each signal's own `cuda_descriptors()`."""
    return _cuda_only(_described(1)[1])


def builtin_descriptors(max_rank_series: int = 1) -> list[MetricDescriptor]:
    """Every name the built-in signals can export, in every shape (with model FLOPs and MFU, on
    CUDA, with NVML, the default phases per rank, one watched metric), for dashboards and alert
    rules that must know them all. With `max_rank_series` 0, as a run wider than its limit
    describes them (before `RankSeriesLimit` turns the rest of its values per rank into statistics)."""
    described, classes = _described(max_rank_series)
    return list({d.name: d for d in described + _cuda_only(classes)}.values())


def signal_descriptors() -> list[MetricDescriptor]:
    """Every name the built-in signals can export, in every shape: the values per rank both as one
    series per rank and as a run above `max_rank_series` ranks exports them; a hang report's and the
    captures'."""
    found: dict[str, MetricDescriptor] = {}
    for max_rank_series in (1, 0):
        described = RankSeriesLimit(1, max_rank_series).describe(builtin_descriptors(max_rank_series))
        found.update((d.name, d) for d in described)
    found.update((d.name, d) for d in (*HANG_DESCRIPTORS, *CAPTURE_DESCRIPTORS))
    return list(found.values())


def event_only_descriptors() -> list[MetricDescriptor]:
    """The names the built-in signals export only once something happened in the run, so that a
    healthy run has none: each signal's own `event_names` (the captures' among them) and a hang
    report's."""
    declared = {name for cls in (*_described(1)[1], Captures) for name in cls.event_names}
    declared |= {descriptor.name for descriptor in HANG_DESCRIPTORS}
    return [descriptor for descriptor in signal_descriptors() if descriptor.name in declared]
