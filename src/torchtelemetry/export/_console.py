"""`ConsoleExporter`: one compact human-readable line per report, no server needed."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from torchtelemetry.export._hub import HEALTH_PREFIX, FailureLog, warn_closed_again
from torchtelemetry.export._protocol import ExportResult, RunInfo
from torchtelemetry.report import HistogramValue, MetricDescriptor, Scalars

__all__ = ["ConsoleExporter"]

logger = logging.getLogger(__name__)


class ConsoleExporter:
    """Writes `step 120 [run] loss=0.4213 step_time{rank}=0:0.101,1:0.12 grad_norm=hist(n=64 mean=0.53)`.

    The hub's health metrics are left out of the line unless an exporter has
    errors or dropped reports, which are appended. `stream` defaults to the
    `sys.stderr` of the moment of each write.
    """

    def __init__(self, stream: TextIO | None = None, *, name: str = "console") -> None:
        self.name = name
        self._stream = stream
        self._run_id = ""
        self._closed = False
        self._failures = FailureLog(f"ConsoleExporter {name!r}", logger)

    def describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Remember the run id for the line prefix."""
        self._run_id = run.run_id

    def export(self, step: int, scalars: Scalars, timestamp: float) -> ExportResult:
        """Write one line."""
        if self._closed:
            self._failures.failed("export() after close()")
            return ExportResult.FAILURE
        try:
            stream = self._stream or sys.stderr
            stream.write(self.format_line(step, scalars, timestamp) + "\n")
            stream.flush()
        except Exception as error:
            self._failures.failed(f"writing step {step} failed", error)
            return ExportResult.FAILURE
        self._failures.succeeded()
        return ExportResult.SUCCESS

    def format_line(self, step: int, scalars: Scalars, timestamp: float) -> str:
        """The line written for one report (without newline)."""
        clock = time.strftime("%H:%M:%S", time.localtime(timestamp))
        parts = [f"{clock} step {step} [{self._run_id}]"]
        parts.extend(
            f"{name}={_format(value)}"
            for name, value in scalars.items()
            if not name.startswith(HEALTH_PREFIX)
        )
        trouble = [
            f"{name.removeprefix(HEALTH_PREFIX)}:{exporter}={value:g}"
            for name in ("exporter/errors", "exporter/dropped_reports")
            if isinstance(counts := scalars.get(name), Mapping)
            for exporter, value in counts.items()
            if value
        ]
        if trouble:
            parts.append(f"| {' '.join(trouble)}")
        return " ".join(parts)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Flush the stream."""
        try:
            (self._stream or sys.stderr).flush()
        except Exception as error:
            self._failures.failed("flush failed", error)
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush; the stream is the caller's and stays open. A second call only warns."""
        if self._closed:
            warn_closed_again(f"ConsoleExporter {self.name!r}")
            return
        self.force_flush(timeout_s)
        self._closed = True


def _format(value: object) -> str:
    if isinstance(value, HistogramValue):
        mean = value.sum / value.count if value.count else math.nan
        return f"hist(n={value.count:g} mean={mean:.4g})"
    if isinstance(value, Mapping):
        return ",".join(f"{label}:{entry:.4g}" for label, entry in value.items())
    return f"{value:.4g}"
