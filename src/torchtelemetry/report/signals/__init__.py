"""Built-in training signals, one small object each (`Signal`), routed by a `SignalSet`.

Step time, data wait, tokens and samples with their rates, model FLOPs, learning rate, peak memory;
and for health: phases, the sync wait and straggler scores, the non-finite sentinel and spike scores, memory
health, goodput, GPU health (NVML), and per layer (`watch_layers`) the norms and where a NaN was
born. Adding a signal is one module, its test, a line in `builtin_signals` and its doc rows
(docs/signals.md, "Adding a signal", which lists every name, unit and cost). Hangs are not a
window's signal (a hang stops the windows): `torchtelemetry.run` watches them; `_hang` holds the
names of the hang report and the phase labels the heartbeat reserves. `_captures` carries the run's
capture orders and outcomes in the window.
"""

from __future__ import annotations

from torchtelemetry.report.signals._base import (
    RankValues,
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)
from torchtelemetry.report.signals._builtin import (
    DEFAULT_SPIKE_SIGMA,
    DEFAULT_SPIKE_WINDOWS,
    DEFAULT_TOP_K,
    builtin_descriptors,
    builtin_signals,
    cuda_only_descriptors,
    event_only_descriptors,
    signal_descriptors,
)
from torchtelemetry.report.signals._captures import (
    CAPTURE_DESCRIPTORS,
    CAPTURE_REASONS,
    CAPTURE_TRIGGERS,
    IDLE,
    CaptureOrder,
    CaptureOutcomes,
    CaptureReport,
    Captures,
    CaptureSource,
    CaptureWindow,
    Verdict,
    check_capture_reason,
)
from torchtelemetry.report.signals._clock import (
    HostClock,
    HostPhaseTimer,
    HostTimer,
    PhaseClock,
    PhaseTimer,
    TracedHostClock,
    TracedHostTimer,
)
from torchtelemetry.report.signals._data_wait import DATA_PHASE, DataWait
from torchtelemetry.report.signals._event_clock import EventClock
from torchtelemetry.report.signals._goodput import Goodput, GoodputReading, GoodputSource, goodput_gauges
from torchtelemetry.report.signals._hang import (
    BETWEEN_PHASES,
    CLOSED_PHASE,
    COLLECT_PHASE,
    HANG_DESCRIPTORS,
    HEARTBEAT_LABELS,
    UNKNOWN_PHASE,
)
from torchtelemetry.report.signals._layer_model import ROOT_LAYER, copies
from torchtelemetry.report.signals._layer_state import (
    DEFAULT_LAYER_STATS,
    LAYER_STATS,
    LayerState,
    LayerWatch,
)
from torchtelemetry.report.signals._layers import DEFAULT_MAX_LAYER_SERIES, LayerStatistics
from torchtelemetry.report.signals._learning_rate import LearningRate
from torchtelemetry.report.signals._memory_health import MemoryHealth, memory_descriptors, resident_bytes
from torchtelemetry.report.signals._nonfinite import CountingUpdate, NonFiniteSentinel, watched_metrics
from torchtelemetry.report.signals._nvml import (
    THROTTLE_REASONS,
    GpuHealth,
    NvmlReader,
    gpu_descriptors,
    open_nvml,
)
from torchtelemetry.report.signals._peak_memory import PeakMemory
from torchtelemetry.report.signals._phases import DEFAULT_PHASES, Phases, check_phase_names
from torchtelemetry.report.signals._set import SignalSet
from torchtelemetry.report.signals._span_names import (
    ATTEMPT_ATTRIBUTE,
    PHASE_ATTRIBUTE,
    RANK_ATTRIBUTE,
    RUN_ID_ATTRIBUTE,
    SPAN_ATTRIBUTES,
    STEP_ATTRIBUTE,
    STEP_SPAN,
    SpanName,
    span_name,
    span_names,
)
from torchtelemetry.report.signals._spikes import MIN_HISTORY, Spikes
from torchtelemetry.report.signals._step_time import STEP_TIME_BOUNDS, STEP_TIME_HISTOGRAM, StepTime
from torchtelemetry.report.signals._stragglers import (
    DEFAULT_SYNC_PHASE,
    MIN_COST,
    MIN_EXCESS,
    MIN_NOISE_WINDOWS,
    NOISE_SPREADS,
    NOISE_WINDOWS,
    StragglerScores,
)
from torchtelemetry.report.signals._sync_wait import SYNC_WAIT, SyncWait
from torchtelemetry.report.signals._throughput import Count, ModelFlopsSignal, check_count
from torchtelemetry.report.signals._timeline import (
    CHECKPOINT_SECTION,
    NO_SECTIONS,
    SYNC_WAIT_SECTION,
    HostAnchor,
    LateSections,
    Section,
    SectionLog,
    WindowSections,
)
from torchtelemetry.report.signals._trace_sampling import (
    TraceSample,
    TraceSampling,
    TraceSink,
    sample_ranks,
    section_kinds,
)

__all__ = [
    "ATTEMPT_ATTRIBUTE",
    "PHASE_ATTRIBUTE",
    "RANK_ATTRIBUTE",
    "RUN_ID_ATTRIBUTE",
    "SPAN_ATTRIBUTES",
    "STEP_ATTRIBUTE",
    "STEP_SPAN",
    "SpanName",
    "span_name",
    "span_names",
    "CHECKPOINT_SECTION",
    "NO_SECTIONS",
    "STEP_TIME_BOUNDS",
    "STEP_TIME_HISTOGRAM",
    "SYNC_WAIT_SECTION",
    "HostAnchor",
    "TracedHostClock",
    "TracedHostTimer",
    "LateSections",
    "Section",
    "SectionLog",
    "TraceSample",
    "TraceSampling",
    "TraceSink",
    "WindowSections",
    "sample_ranks",
    "section_kinds",
    "CAPTURE_DESCRIPTORS",
    "CAPTURE_REASONS",
    "CAPTURE_TRIGGERS",
    "CaptureOrder",
    "CaptureOutcomes",
    "CaptureReport",
    "CaptureSource",
    "CaptureWindow",
    "IDLE",
    "Captures",
    "Verdict",
    "check_capture_reason",
    "BETWEEN_PHASES",
    "CLOSED_PHASE",
    "COLLECT_PHASE",
    "HANG_DESCRIPTORS",
    "HEARTBEAT_LABELS",
    "UNKNOWN_PHASE",
    "DEFAULT_SPIKE_SIGMA",
    "DEFAULT_SPIKE_WINDOWS",
    "DEFAULT_TOP_K",
    "Count",
    "DEFAULT_LAYER_STATS",
    "DEFAULT_MAX_LAYER_SERIES",
    "LAYER_STATS",
    "LayerState",
    "LayerStatistics",
    "LayerWatch",
    "ROOT_LAYER",
    "copies",
    "DataWait",
    "LearningRate",
    "ModelFlopsSignal",
    "PeakMemory",
    "StepTime",
    "signal_descriptors",
    "DATA_PHASE",
    "DEFAULT_PHASES",
    "DEFAULT_SYNC_PHASE",
    "MIN_COST",
    "MIN_EXCESS",
    "MIN_HISTORY",
    "MIN_NOISE_WINDOWS",
    "NOISE_SPREADS",
    "NOISE_WINDOWS",
    "SYNC_WAIT",
    "THROTTLE_REASONS",
    "CountingUpdate",
    "EventClock",
    "GpuHealth",
    "Goodput",
    "GoodputReading",
    "GoodputSource",
    "HostClock",
    "HostPhaseTimer",
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
    "SyncWait",
    "WindowTiming",
    "builtin_descriptors",
    "builtin_signals",
    "cuda_only_descriptors",
    "event_only_descriptors",
    "check_count",
    "check_phase_names",
    "finite_by_rank",
    "gpu_descriptors",
    "highest_rank",
    "lowest_rank",
    "memory_descriptors",
    "open_nvml",
    "goodput_gauges",
    "resident_bytes",
    "watched_metrics",
]
