"""Temporality: each exporter states whether it wants running totals or per-report deltas.

Counters and histograms travel as running totals (kept, and checkpointed, by
`torchtelemetry.report.RunningTotals`). An exporter that prefers deltas for a kind declares
`preferred_temporality = {MetricKind.HISTOGRAM: Temporality.DELTA}` (as the OpenTelemetry SDK's
exporters do), and its queue hands it what changed since the last report it accepted.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report import MetricDescriptor, ReportValue, ReportValues, difference

__all__ = ["DeltaConverter", "Temporality", "preferred_temporality"]


class Temporality(enum.Enum):
    """How an exporter receives counters and histograms."""

    CUMULATIVE = "cumulative"
    """Running totals since the start of the run (the default)."""
    DELTA = "delta"
    """What changed since the last report the exporter accepted."""


def preferred_temporality(exporter: Any) -> dict[MetricKind, Temporality]:
    """The exporter's `preferred_temporality` (cumulative for kinds it does not name), checked."""
    declared = getattr(exporter, "preferred_temporality", None) or {}
    preference = dict.fromkeys((MetricKind.COUNTER, MetricKind.HISTOGRAM), Temporality.CUMULATIVE)
    for kind, temporality in declared.items():
        if kind not in preference or not isinstance(temporality, Temporality):
            raise ValueError(
                f"exporter {exporter.name!r}: preferred_temporality maps {kind!r} to {temporality!r}; "
                "it maps MetricKind.COUNTER or MetricKind.HISTOGRAM to a Temporality"
            )
        preference[kind] = temporality
    return preference


class DeltaConverter:
    """Turns the running totals of the kinds an exporter wants as deltas into deltas, for one exporter.

    The delta of a name is its total minus the total in the last report the exporter accepted,
    so a report dropped from a full queue, or one the exporter failed, is folded into the next
    delta instead of lost. The first report (after a start or a restart from a checkpoint) carries
    the window's own value. Used by one thread at a time (the exporter's).
    """

    def __init__(self, preference: Mapping[MetricKind, Temporality]) -> None:
        self._delta_kinds = frozenset(kind for kind, t in preference.items() if t is Temporality.DELTA)
        self._delta_names: set[str] = set()
        self._accepted: dict[str, ReportValue] = {}
        self._offered: dict[str, ReportValue] = {}

    def learn(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Learn which names are of a kind the exporter wants as deltas."""
        self._delta_names |= {d.name for d in descriptors if d.kind in self._delta_kinds}

    def convert(self, values: ReportValues, window: ReportValues) -> ReportValues:
        """`values` with deltas in place of the running totals of delta names.

        `window` holds the window's own values (what the totals added this time).
        """
        self._offered = {}
        names = self._delta_names & values.keys()
        if not names:
            return values
        converted = dict(values)
        for name in names:
            total = values[name]
            earlier = self._accepted.get(name)
            delta = None if earlier is None else difference(total, earlier)
            converted[name] = delta if delta is not None else window.get(name, total)
            self._offered[name] = total
        return converted

    def accepted(self) -> None:
        """The exporter accepted the last converted report: later deltas start from its totals."""
        self._accepted.update(self._offered)
        self._offered = {}
