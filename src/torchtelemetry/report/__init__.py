"""Reports: a window's results as named values, the built-in training signals and the running totals.

Between collection and export: `flatten_results` names each metric's results by its path in the
tree (`train/loss`), the built-in signals of `report.signals` (one object each, routed by a
`SignalSet`: step time, throughput, phases, stragglers, non-finite counts, memory, goodput, GPU)
add theirs, `RunningTotals` turns counters and histograms into totals across windows and restarts,
`WindowPublisher` submits one report per window in step order, and the path rules say which names
a report may carry (how each backend spells a path is `torchtelemetry.export`'s rule).
"""

from torchtelemetry.report._checkpoint import restore_run_state, run_state
from torchtelemetry.report._clock import wall_time
from torchtelemetry.report._flatten import describe_metrics, flatten_results, to_python
from torchtelemetry.report._flops import PEAK_FLOPS, ModelFlops, model_flops, peak_flops_of
from torchtelemetry.report._memory import allocator_metrics
from torchtelemetry.report._naming import (
    MAX_NAME_LENGTH,
    InvalidMetricNameError,
    NameCollisionError,
    path_segment,
    sanitize_path,
    validate_path,
)
from torchtelemetry.report._publisher import Submit, WindowPublisher, describe_with_signals
from torchtelemetry.report._ranks import RankSeriesLimit
from torchtelemetry.report._totals import RunningTotals, difference
from torchtelemetry.report._values import HistogramValue, MetricDescriptor, ReportValue, ReportValues
from torchtelemetry.report.signals import (
    COLLECT_PHASE,
    DATA_PHASE,
    DEFAULT_LAYER_STATS,
    DEFAULT_MAX_LAYER_SERIES,
    DEFAULT_PHASES,
    DEFAULT_SPIKE_SIGMA,
    DEFAULT_SPIKE_WINDOWS,
    DEFAULT_TOP_K,
    HANG_DESCRIPTORS,
    MIN_HISTORY,
    GoodputReading,
    GoodputSource,
    Heartbeat,
    HostTimer,
    PhaseTimer,
    RankBeat,
    SignalContext,
    SignalSet,
    WindowTiming,
    builtin_signals,
    check_phase_names,
    find_hang,
    goodput_gauges,
    hang_values,
    signal_descriptors,
)

__all__ = [
    "DATA_PHASE",
    "DEFAULT_LAYER_STATS",
    "DEFAULT_MAX_LAYER_SERIES",
    "DEFAULT_PHASES",
    "DEFAULT_SPIKE_SIGMA",
    "DEFAULT_SPIKE_WINDOWS",
    "DEFAULT_TOP_K",
    "MIN_HISTORY",
    "COLLECT_PHASE",
    "HANG_DESCRIPTORS",
    "Heartbeat",
    "HostTimer",
    "RankBeat",
    "find_hang",
    "hang_values",
    "PhaseTimer",
    "GoodputReading",
    "GoodputSource",
    "goodput_gauges",
    "SignalContext",
    "SignalSet",
    "check_phase_names",
    "builtin_signals",
    "MAX_NAME_LENGTH",
    "PEAK_FLOPS",
    "HistogramValue",
    "InvalidMetricNameError",
    "MetricDescriptor",
    "ModelFlops",
    "NameCollisionError",
    "RankSeriesLimit",
    "RunningTotals",
    "ReportValue",
    "ReportValues",
    "Submit",
    "WindowPublisher",
    "WindowTiming",
    "allocator_metrics",
    "difference",
    "describe_metrics",
    "describe_with_signals",
    "flatten_results",
    "model_flops",
    "path_segment",
    "peak_flops_of",
    "restore_run_state",
    "run_state",
    "sanitize_path",
    "signal_descriptors",
    "to_python",
    "validate_path",
    "wall_time",
]
