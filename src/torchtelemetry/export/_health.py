"""The hub's health metrics: what each exporter delivered, failed and dropped, under one vocabulary.

The same four names are used everywhere: `ExporterHealth` fields, the report values
(`exporter/exported_reports`, `exporter/errors`, `exporter/dropped_reports`,
`exporter/last_success_timestamp`, labelled by exporter), the Prometheus series
(`torchtelemetry_exporter_exported_reports_total`, ...), the dashboards and the alert rules.
`ExporterQueue` is the one place they are counted, for every exporter alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchtelemetry.metric import MetricKind
from torchtelemetry.report import MetricDescriptor, ReportValue

__all__ = ["HEALTH_DESCRIPTORS", "HEALTH_PREFIX", "ExporterHealth", "health_values"]

HEALTH_PREFIX = "exporter/"
"""Path prefix of the hub's own health metrics."""

HEALTH_DESCRIPTORS = (
    MetricDescriptor(
        "exporter/exported_reports",
        MetricKind.COUNTER,
        description="Reports exported, per exporter.",
        label_name="exporter",
    ),
    MetricDescriptor(
        "exporter/errors",
        MetricKind.COUNTER,
        description="Failed exports and describes, per exporter.",
        label_name="exporter",
    ),
    MetricDescriptor(
        "exporter/dropped_reports",
        MetricKind.COUNTER,
        description="Reports dropped because the exporter's queue was full, per exporter.",
        label_name="exporter",
    ),
    MetricDescriptor(
        "exporter/last_success_timestamp",
        MetricKind.GAUGE,
        unit="seconds",
        description="Unix time of the last successful export, per exporter.",
        label_name="exporter",
    ),
)
"""Descriptors of the health metrics every report carries."""


@dataclass(frozen=True, slots=True)
class ExporterHealth:
    """Counters of one exporter, as seen by the hub."""

    exported_reports: int
    """Reports the exporter accepted (`ExportResult.SUCCESS`)."""
    errors: int
    """Exports and describes that failed or raised."""
    dropped_reports: int
    """Reports dropped, oldest first, because the exporter's queue was full (or close ran out of time)."""
    last_success_timestamp: float | None
    """Unix time of the last successful export; None before the first."""


def health_values(healths: Mapping[str, ExporterHealth]) -> dict[str, ReportValue]:
    """The health metrics as report values (one value per exporter name)."""
    values: dict[str, ReportValue] = {
        "exporter/exported_reports": {name: float(h.exported_reports) for name, h in healths.items()},
        "exporter/errors": {name: float(h.errors) for name, h in healths.items()},
        "exporter/dropped_reports": {name: float(h.dropped_reports) for name, h in healths.items()},
    }
    last_success = {
        name: h.last_success_timestamp for name, h in healths.items() if h.last_success_timestamp is not None
    }
    if last_success:
        values["exporter/last_success_timestamp"] = last_success
    return values
