"""`JsonlExporter`: one JSON object per report, appended to a file."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from torchtelemetry.export._hub import FailureLog, warn_closed_again
from torchtelemetry.export._protocol import ExportResult, RunInfo
from torchtelemetry.report import HistogramValue, MetricDescriptor, Scalars

__all__ = ["JsonlExporter"]

logger = logging.getLogger(__name__)


class JsonlExporter:
    """Appends `{"step", "timestamp", "run_id", "values"}` per report to `path` (opened on first describe).

    Values keep their shape: floats, `{label: float}` mappings, and histograms
    as `{"bounds", "counts", "sum", "count"}`. Non-finite floats are written as
    null so every line is standard JSON.
    """

    def __init__(self, path: str | os.PathLike[str] = "torchtelemetry.jsonl", *, name: str = "jsonl") -> None:
        self.name = name
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._run_id = ""
        self._closed = False
        self._failures = FailureLog(f"JsonlExporter {name!r} ({self.path})", logger)

    def describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Remember the run id and open the file for appending (parents are created)."""
        self._run_id = run.run_id
        if self._file is None and not self._closed:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def export(self, step: int, scalars: Scalars, timestamp: float) -> ExportResult:
        """Append one line."""
        if self._file is None:
            self._failures.failed("export() before describe() or after close()")
            return ExportResult.FAILURE
        try:
            record = {
                "step": step,
                "timestamp": timestamp,
                "run_id": self._run_id,
                "values": {name: _jsonable(value) for name, value in scalars.items()},
            }
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        except Exception as error:
            self._failures.failed(f"writing step {step} failed", error)
            return ExportResult.FAILURE
        self._failures.succeeded()
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Flush and fsync the file."""
        if self._file is None:
            return not self._closed
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            self._failures.failed("flush failed", error)
            return False
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and close the file; a second call only warns."""
        if self._closed:
            warn_closed_again(f"JsonlExporter {self.name!r}")
            return
        self.force_flush(timeout_s)
        self._closed = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError as error:
                logger.warning("JsonlExporter %r: closing %s failed: %s", self.name, self.path, error)
            self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, HistogramValue):
        return {
            "bounds": list(value.bounds),
            "counts": [_finite(c) for c in value.counts],
            "sum": _finite(value.sum),
            "count": _finite(value.count),
        }
    if isinstance(value, Mapping):
        return {str(label): _finite(entry) for label, entry in value.items()}
    return _finite(value)


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
