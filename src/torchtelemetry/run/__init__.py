"""What lasts for the whole run, beyond one window: its identity and attempts, the progress file,
the heartbeat and the hang monitor, goodput's lasting state, captures and traces.

`Telemetry` builds these from narrow arguments; the per-window `Signal` hooks stay in
`torchtelemetry.report.signals`.
"""

# Hangs: each rank's heartbeat, the exporting rank's monitor, the next rank's deputy (docs/signals.md).
from torchtelemetry.run._hangs import BeatLedger, Hang, RankBeat, Reading, find_hang, hang_values
from torchtelemetry.run._heartbeat import Heartbeat
from torchtelemetry.run._watch import HangSettings, HangWatch, watch_hangs

__all__ = [
    # Hangs
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
]
