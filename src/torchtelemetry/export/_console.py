"""`ConsoleExporter`: one compact human-readable line per report, no server needed."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from torchtelemetry.export._base import BaseExporter
from torchtelemetry.export._health import HEALTH_PREFIX
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.report import HistogramValue, MetricDescriptor, ReportValues

__all__ = ["ConsoleExporter"]


class ConsoleExporter(BaseExporter):
    """Writes `step 120 [run] loss=0.4213 step_time{rank}=0:0.101,1:0.12 grad_norm=hist(n=64 mean=0.53)`.

    The hub's health metrics are left out of the line unless an exporter has
    errors or dropped reports, which are appended. `stream` defaults to the
    `sys.stderr` of the moment of each write; it is the caller's and stays open.
    """

    def __init__(self, stream: TextIO | None = None, *, name: str = "console") -> None:
        super().__init__(name)
        self._stream = stream
        self._run_id = ""

    def destination(self) -> str | None:
        return "stderr" if self._stream is None else getattr(self._stream, "name", None)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._run_id = run.run_id

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        stream = self._stream or sys.stderr
        stream.write(self.format_line(step, values, timestamp) + "\n")
        stream.flush()

    def _flush(self, timeout_s: float) -> bool:
        (self._stream or sys.stderr).flush()
        return True

    def format_line(self, step: int, values: ReportValues, timestamp: float) -> str:
        """The line written for one report (without newline)."""
        clock = time.strftime("%H:%M:%S", time.localtime(timestamp))
        parts = [f"{clock} step {step} [{self._run_id}]"]
        parts.extend(
            f"{name}={_format(value)}" for name, value in values.items() if not name.startswith(HEALTH_PREFIX)
        )
        trouble = [
            f"{name.removeprefix(HEALTH_PREFIX)}:{exporter}={value:g}"
            for name in ("exporter/errors", "exporter/dropped_reports")
            if isinstance(counts := values.get(name), Mapping)
            for exporter, value in counts.items()
            if value
        ]
        if trouble:
            parts.append(f"| {' '.join(trouble)}")
        return " ".join(parts)


def _format(value: object) -> str:
    if isinstance(value, HistogramValue):
        mean = value.sum / value.count if value.count else math.nan
        return f"hist(n={value.count:g} mean={mean:.4g})"
    if isinstance(value, Mapping):
        return ",".join(f"{label}:{entry:.4g}" for label, entry in value.items())
    return f"{value:.4g}"
