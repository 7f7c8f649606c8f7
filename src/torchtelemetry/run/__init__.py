"""What lasts for the whole run, beyond one window: its identity and attempts, the progress file,
the heartbeat and the hang monitor, goodput's lasting state, captures and traces.

`Telemetry` builds these from narrow arguments; the per-window `Signal` hooks stay in
`torchtelemetry.report.signals`.
"""

from torchtelemetry.run._capture import CaptureRun, CaptureSettings
from torchtelemetry.run._dumps import HangCaptures, flight_recorder_on
from torchtelemetry.run._goodput import GoodputLedger
from torchtelemetry.run._hangs import BeatLedger, Hang, RankBeat, Reading, find_hang, hang_values
from torchtelemetry.run._heartbeat import Heartbeat
from torchtelemetry.run._identity import RunIdentity, launcher_run_id, resolve_run_identity
from torchtelemetry.run._progress import ProgressFile, ProgressRecord, RunProgress, progress_path
from torchtelemetry.run._trace_ids import hex_span_id, hex_trace_id, span_id, trace_id
from torchtelemetry.run._trace_spans import TracedWindow, window_spans
from torchtelemetry.run._traces import (
    DEFAULT_TRACE_RANKS,
    TRACES_THREAD,
    RunTraces,
    checked_attempt,
    run_traces,
)
from torchtelemetry.run._watch import HangSettings, HangWatch, watch_hangs

__all__ = [
    # identity and attempts, the progress file, goodput's lasting state
    "GoodputLedger",
    "ProgressFile",
    "ProgressRecord",
    "RunIdentity",
    "RunProgress",
    "launcher_run_id",
    "progress_path",
    "resolve_run_identity",
    # traces: spans of the sampled ranks' steps, their ids
    "DEFAULT_TRACE_RANKS",
    "checked_attempt",
    "run_traces",
    "TRACES_THREAD",
    "RunTraces",
    "TracedWindow",
    "hex_span_id",
    "hex_trace_id",
    "span_id",
    "trace_id",
    "window_spans",
    # hangs: each rank's heartbeat, the exporting rank's monitor, the next rank's deputy (docs/signals.md)
    "BeatLedger",
    "Hang",
    "HangSettings",
    "HangWatch",
    "Heartbeat",
    "RankBeat",
    "Reading",
    "find_hang",
    "hang_values",
    "watch_hangs",
    # captures: the evidence of a verdict on the rank it names (docs/signals.md, Captures)
    "CaptureRun",
    "CaptureSettings",
    "HangCaptures",
    "flight_recorder_on",
]
