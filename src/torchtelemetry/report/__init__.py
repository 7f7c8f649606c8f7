"""Reports: a window's results as named values, the built-in training signals and the running totals.

Between collection and export: `flatten_results` names each metric's results by its path in the
tree (`train/loss`), the built-in signals of `report.signals` (one object each, routed by a
`SignalSet`: step time, throughput, phases, stragglers, non-finite counts, memory, goodput, GPU)
add theirs, `RunningTotals` turns counters and histograms into totals across windows and restarts,
`WindowPublisher` submits one report per window in step order, and the naming rules say how each
backend spells a path.
"""

from torchtelemetry.report._checkpoint import restore_run_state, run_state
from torchtelemetry.report._clock import wall_time
from torchtelemetry.report._flatten import describe_metrics, flatten_results
from torchtelemetry.report._flops import PEAK_FLOPS, ModelFlops, model_flops, peak_flops_of
from torchtelemetry.report._memory import allocator_metrics
from torchtelemetry.report._naming import (
    LAST_UPDATE_METRIC,
    MAX_NAME_LENGTH,
    NAMESPACE,
    RUN_FINISHED_METRIC,
    STEP_METRIC,
    InvalidMetricNameError,
    NameCollisionError,
    TrackerKeys,
    check_unique,
    merge_descriptors,
    otel_name,
    otel_unit,
    prometheus_label_name,
    prometheus_name,
    sanitize_path,
    tracker_label_name,
    tracker_name,
    validate_path,
)
from torchtelemetry.report._publisher import WindowPublisher, describe_with_signals
from torchtelemetry.report._ranks import RankSeriesLimit
from torchtelemetry.report._totals import RunningTotals, difference
from torchtelemetry.report._values import HistogramValue, MetricDescriptor, Scalars, ScalarValue
from torchtelemetry.report.signals import (
    DATA_PHASE,
    DEFAULT_PHASES,
    DEFAULT_SPIKE_SIGMA,
    DEFAULT_SPIKE_WINDOWS,
    DEFAULT_TOP_K,
    MIN_HISTORY,
    HostTimer,
    PhaseTimer,
    SignalContext,
    SignalSet,
    WindowTiming,
    builtin_signals,
    check_phase_names,
    signal_descriptors,
)

__all__ = [
    "DATA_PHASE",
    "DEFAULT_PHASES",
    "DEFAULT_SPIKE_SIGMA",
    "DEFAULT_SPIKE_WINDOWS",
    "DEFAULT_TOP_K",
    "MIN_HISTORY",
    "HostTimer",
    "PhaseTimer",
    "SignalContext",
    "SignalSet",
    "check_phase_names",
    "builtin_signals",
    "LAST_UPDATE_METRIC",
    "RUN_FINISHED_METRIC",
    "MAX_NAME_LENGTH",
    "NAMESPACE",
    "PEAK_FLOPS",
    "STEP_METRIC",
    "HistogramValue",
    "InvalidMetricNameError",
    "MetricDescriptor",
    "ModelFlops",
    "NameCollisionError",
    "RankSeriesLimit",
    "RunningTotals",
    "ScalarValue",
    "Scalars",
    "TrackerKeys",
    "WindowPublisher",
    "WindowTiming",
    "allocator_metrics",
    "check_unique",
    "difference",
    "describe_metrics",
    "describe_with_signals",
    "flatten_results",
    "merge_descriptors",
    "model_flops",
    "otel_name",
    "otel_unit",
    "peak_flops_of",
    "prometheus_label_name",
    "prometheus_name",
    "restore_run_state",
    "run_state",
    "sanitize_path",
    "signal_descriptors",
    "validate_path",
    "wall_time",
    "tracker_label_name",
    "tracker_name",
]
