"""`JsonlExporter`: one JSON object per report, appended to a file."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.report import HistogramValue, MetricDescriptor, ReportValues

__all__ = ["JsonlExporter"]

logger = logging.getLogger(__name__)

_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class JsonlExporter(BaseExporter):
    """Appends `{"step", "timestamp", "run_id", "values"}` per report to `path` (opened on first describe).

    Values keep their shape: floats, `{label: float}` mappings, and histograms
    as `{"bounds", "counts", "sum", "count"}`. Non-finite floats are written as the JSON
    strings "NaN", "Infinity" and "-Infinity" (as OpenTelemetry's JSON encoding does), so every
    line is standard JSON and a NaN loss is told apart from a missing one. A new file is made mode
    0600; a symbolic link at `path` is never followed (the exporter logs it, and its exports fail).
    """

    def __init__(self, path: str | os.PathLike[str] = "torchtelemetry.jsonl", *, name: str = "jsonl") -> None:
        super().__init__(name, subject=f"JsonlExporter {name!r} ({path})")
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._run_id = ""

    def destination(self) -> str | None:
        return str(self.path)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._run_id = run.run_id

    def _start(self, run: RunInfo) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = os.fdopen(os.open(self.path, _APPEND, 0o600), "a", encoding="utf-8")
        except OSError as error:
            reason = "a symbolic link, never followed" if self.path.is_symlink() else error.strerror
            logger.warning(
                "JsonlExporter %r: cannot open %s (%s); its reports fail", self.name, self.path, reason
            )

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        if self._file is None:
            raise ExportFailed(f"{self.path} could not be opened at describe()")
        record = {
            "step": step,
            "timestamp": timestamp,
            "run_id": self._run_id,
            "values": {name: _jsonable(value) for name, value in values.items()},
        }
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def _flush(self, timeout_s: float) -> bool:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return True

    def _close(self, timeout_s: float) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


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


def _finite(value: Any) -> float | str:
    """`value` as a float, or its name as a JSON string when it is not finite."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
