"""The names of a hang report (`train/hang/*`) and the phase labels the heartbeat reserves.

Hangs are not a window's signal (a hang stops the windows): `torchtelemetry.run` watches them and
exports these names from the exporting rank's monitor (docs/signals.md, Hangs). They are declared
here, beside the signals' names, so that every table of names and the phase-name check know them.
"""

from __future__ import annotations

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor

__all__ = [
    "BETWEEN_PHASES",
    "CLOSED_PHASE",
    "COLLECT_PHASE",
    "HANG_DESCRIPTORS",
    "HEARTBEAT_LABELS",
    "UNKNOWN_PHASE",
]

BETWEEN_PHASES = "none"
"""The phase label of a rank inside no phase (between `step()` and its first phase)."""
COLLECT_PHASE = "collect"
"""The phase label of a training thread waiting for a window's collection."""
CLOSED_PHASE = "closed"
"""The phase label of a rank that left the loop: its `Telemetry.close()` began."""
UNKNOWN_PHASE = "unknown"
"""The phase label of a rank that stopped publishing before the step it is reported at."""
HEARTBEAT_LABELS = (BETWEEN_PHASES, COLLECT_PHASE, CLOSED_PHASE, UNKNOWN_PHASE)
"""Phase labels of the heartbeat's own: no declared phase may take one (`check_phase_names`)."""

HANG_DESCRIPTORS = (
    MetricDescriptor(
        "train/hang/seconds",
        MetricKind.GAUGE,
        "seconds",
        "Seconds since the rank furthest behind last made progress (0: no hang)",
    ),
    MetricDescriptor("train/hang/rank", MetricKind.GAUGE, "", "Rank furthest behind in the last hang"),
    MetricDescriptor("train/hang/step", MetricKind.GAUGE, "", "Step the rank furthest behind stopped in"),
    MetricDescriptor(
        "train/hang/phase",
        MetricKind.GAUGE,
        "",
        "1 for the phase the rank furthest behind stopped in (no series: no hang)",
        "phase",
    ),
    MetricDescriptor(
        "train/hang/lost_ranks", MetricKind.GAUGE, "", "Ranks whose heartbeat stopped altogether"
    ),
    MetricDescriptor(
        "train/hang/dump",
        MetricKind.GAUGE,
        "",
        "The stack file the rank furthest behind wrote, as label; the value is that rank",
        "file",
    ),
    MetricDescriptor(
        "train/hang/unwatched_ranks",
        MetricKind.GAUGE,
        "",
        "Ranks that never joined the heartbeat store (hang detection off there)",
    ),
    MetricDescriptor(
        "train/hang/rejected_values",
        MetricKind.GAUGE,
        "",
        "Heartbeat values ignored so far: forged, malformed or replayed",
    ),
)
"""Every name a hang report carries; exported by the exporting rank's monitor (or, when the
exporting rank itself stopped, by the next rank), not by windows."""
