"""What lasts for the whole run, beyond one window: its identity and attempts, the progress file,
the heartbeat and the hang monitor, goodput's lasting state, captures and traces.

`Telemetry` builds these from narrow arguments; the per-window `Signal` hooks stay in
`torchtelemetry.report.signals`.
"""

from torchtelemetry.run._goodput import GoodputLedger
from torchtelemetry.run._identity import RunIdentity, launcher_run_id, resolve_run_identity
from torchtelemetry.run._progress import ProgressFile, ProgressRecord, RunProgress, progress_path

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
]
