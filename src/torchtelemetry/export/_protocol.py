"""The `Exporter` protocol, its result and the run it exports."""

from __future__ import annotations

import enum
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torchtelemetry.report import MetricDescriptor, ReportValues

__all__ = ["RUN_ID_ENV", "ExportResult", "Exporter", "ExporterStartError", "RunInfo"]


class ExportResult(enum.Enum):
    """Outcome of one `Exporter.export` call."""

    SUCCESS = "success"
    FAILURE = "failure"


class ExporterStartError(RuntimeError):
    """An exporter cannot start as configured (e.g. its port is in use).

    Raised by the first `describe()`, it stops the set-up of `Telemetry` on every rank instead of
    letting the run train on without that exporter.
    """


RUN_ID_ENV = "TORCHTELEMETRY_RUN_ID"
"""Environment variable naming the run when no `run_id` is given."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """The training run being exported; the hub hands it to every exporter with the descriptors."""

    run_id: str
    """Stable id of the run: Prometheus `run` label, OTel `service.instance.id`, W&B run id."""
    world_size: int = 1
    """Number of ranks in the run."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Hyperparameters: W&B config, OTel resource attributes, etc."""

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("RunInfo.run_id must be a non-empty string")
        if self.world_size < 1:
            raise ValueError(f"RunInfo.world_size must be at least 1, got {self.world_size}")

    @classmethod
    def create(
        cls, run_id: str | None = None, *, world_size: int = 1, config: Mapping[str, Any] | None = None
    ) -> RunInfo:
        """Argument, else `$TORCHTELEMETRY_RUN_ID`, else a new `YYYYmmdd-HHMMSS-xxxxxx` id."""
        run_id = (
            run_id or os.environ.get(RUN_ID_ENV) or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        )
        return cls(run_id=run_id, world_size=world_size, config=dict(config or {}))


@runtime_checkable
class Exporter(Protocol):
    """Receives reports from rank 0, on the hub's thread dedicated to this exporter.

    After construction an exporter never raises from `export`, `force_flush` or
    `close`: it logs and reports failure. `describe` may raise `ValueError`
    (e.g. `NameCollisionError`) when the metric tree is first known.

    Counters and histograms arrive as running totals unless the exporter declares an optional
    `preferred_temporality` mapping (`{MetricKind.HISTOGRAM: Temporality.DELTA}`): the hub then
    hands it what changed since the last report it accepted.

    `close()` is bounded by its `timeout_s`; a `BaseExporter` whose readers pull (a scrape
    endpoint) may say it waits longer for them (`BaseExporter.closing_until()`).
    """

    name: str
    """Short name used in logs and in the hub's health metrics (e.g. "prometheus")."""

    def describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Learn the run and the exported names; called before the first export and when new names appear.

        The first call starts the exporter (opens its port, starts its client); it raises
        `ExporterStartError` when the exporter cannot start as configured.
        """
        ...

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        """Publish one report; `timestamp` is Unix seconds at collection."""
        ...

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver anything buffered; True when everything was delivered in time."""
        ...

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and release resources; a second call only warns."""
        ...
