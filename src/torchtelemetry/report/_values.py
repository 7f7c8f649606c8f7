"""The values a report carries: named floats, per-label floats and histograms, and their descriptors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from torchtelemetry.metric import MetricKind

__all__ = ["HistogramValue", "MetricDescriptor", "ReportValue", "ReportValues"]


@dataclass(frozen=True, slots=True)
class HistogramValue:
    """One histogram: upper `bounds`, non-cumulative `counts` (`len(bounds) + 1`, last is +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def cumulative_counts(self) -> list[float]:
        """Counts of values `<= bound` for each bound, then the total (Prometheus `le` buckets)."""
        running, out = 0.0, []
        for count in self.counts:
            running += count
            out.append(running)
        return out


@dataclass(frozen=True, slots=True)
class MetricDescriptor:
    """What an exporter needs to know about one exported name before any value arrives."""

    name: str
    """Slash-separated path, e.g. `train/loss`; each exporter maps it to its backend's rules."""
    kind: MetricKind = MetricKind.GAUGE
    """Gauge, counter (values are running totals) or histogram."""
    unit: str = ""
    """Unit such as "seconds", "bytes", "ratio", "tokens"; empty when dimensionless."""
    description: str = ""
    """Help text."""
    label_name: str | None = None
    """Set when the value is a mapping from label value to float (e.g. "rank")."""


ReportValue: TypeAlias = "float | HistogramValue | Mapping[str, float]"
"""A float (gauge, or a counter's running total), a histogram, or a float per label value."""

ReportValues: TypeAlias = Mapping[str, "float | HistogramValue | Mapping[str, float]"]
"""One report: descriptor name -> value."""
