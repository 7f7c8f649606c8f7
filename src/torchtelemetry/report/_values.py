"""The values a report carries: named floats, per-label floats and histograms, and their descriptors."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from torchtelemetry.metric import MetricKind

__all__ = ["Exemplar", "HistogramValue", "MetricDescriptor", "ReportValue", "ReportValues"]


@dataclass(frozen=True, slots=True)
class Exemplar:
    """One observation of a histogram that links to a trace: the span that took `value`."""

    value: float
    """The observed value (seconds of the step the span times)."""
    timestamp: float
    """Unix time of the observation (the end of the span)."""
    trace_id: str
    """The span's trace id, 32 lower-case hex digits (W3C trace context)."""
    span_id: str
    """The span's id, 16 lower-case hex digits."""


@dataclass(frozen=True, slots=True)
class HistogramValue:
    """One histogram: upper `bounds`, non-cumulative `counts` (`len(bounds) + 1`, last is +Inf), and
    optionally an `exemplar` of the latest window (Prometheus puts it on the bucket its value falls in)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float
    exemplar: Exemplar | None = None

    def cumulative_counts(self) -> list[float]:
        """Counts of values `<= bound` for each bound, then the total (Prometheus `le` buckets)."""
        running, out = 0.0, []
        for count in self.counts:
            running += count
            out.append(running)
        return out

    def exemplar_bucket(self) -> int | None:
        """The index of the bucket the exemplar's value falls in (`le` semantics), None without one."""
        if self.exemplar is None:
            return None
        return bisect.bisect_left(self.bounds, self.exemplar.value)


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
