"""The rank-0 export hub: fans each report out to every exporter's queue, never blocking the caller.

The façade builds an `ExportHub` on rank 0 and a `NullHub` everywhere else, once;
exporters never check the rank. Each exporter sits behind an `ExporterQueue` (its own
thread and bounded queue), so a slow or dead exporter never stalls training or the other
exporters. The hub checks names, describes them, and adds its health metrics
(`torchtelemetry.export._health`) to every report.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

from torchtelemetry._process import check_same_process, current_pid
from torchtelemetry.export._base import warn_closed_again
from torchtelemetry.export._health import HEALTH_DESCRIPTORS, ExporterHealth, health_values
from torchtelemetry.export._protocol import Exporter, RunInfo
from torchtelemetry.export._queue import ExporterQueue, close_exporter
from torchtelemetry.metric import DEFAULT_LABEL_NAME, MetricKind
from torchtelemetry.report import (
    HistogramValue,
    InvalidMetricNameError,
    MetricDescriptor,
    NameCollisionError,
    ReportValue,
    ReportValues,
    validate_path,
    wall_time,
)

__all__ = ["ExportHub", "NullHub"]

logger = logging.getLogger(__name__)


class ExportHub:
    """Fans reports out to exporters, each on its own named daemon thread with a bounded queue.

    Call `describe()` once the metric tree is known (it raises name collisions
    and illegal names right away and starts the threads), then `submit()` each
    report, and `close()` at the end. Built on rank 0 only; other ranks get a
    `NullHub`.
    """

    def __init__(self, exporters: Sequence[Exporter], *, run: RunInfo, queue_size: int = 64) -> None:
        if queue_size < 1:
            raise ValueError(f"ExportHub: queue_size must be at least 1, got {queue_size}")
        names = [exporter.name for exporter in exporters]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(
                f"ExportHub: exporter names {duplicates} appear more than once; "
                "give each exporter a distinct name= (names label the health metrics)"
            )
        self.run = run
        self._queues = [
            ExporterQueue(exporter, run=run, queue_size=queue_size, extra_values=self._health_values)
            for exporter in exporters
        ]
        self._lock = threading.Lock()
        self._descriptors: dict[str, MetricDescriptor] = {}
        self._rejected: set[str] = set()
        self._started = False
        self._closed = False
        self._warned_closed_submit = False
        self._pid = current_pid()

    @property
    def exporters(self) -> list[Exporter]:
        """The exporters, in the order given."""
        return [queue.exporter for queue in self._queues]

    def describe(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Describe the metric tree to every exporter (on this thread), then start the exporter threads.

        Raises `InvalidMetricNameError` for an illegal path and what an exporter's
        `describe` raises as `ValueError` (e.g. `NameCollisionError`) or
        `ExporterStartError` (e.g. a port in use); other errors are logged and
        counted. Later calls add names and are described on the exporters' threads,
        like names first seen by `submit()`.
        """
        for descriptor in descriptors:
            validate_path(descriptor.name)
        taken = sorted({d.name for d in descriptors} & {d.name for d in HEALTH_DESCRIPTORS})
        if taken:
            raise NameCollisionError(
                f"ExportHub.describe: {taken} are the hub's own health metrics; rename yours"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("ExportHub.describe: the hub is closed")
            merged = {**self._descriptors, **{d.name: d for d in (*descriptors, *HEALTH_DESCRIPTORS)}}
            everything = tuple(merged.values())
            if self._started:
                self._descriptors = merged
                for queue in self._queues:
                    queue.put_describe(everything)
                return
            for queue in self._queues:
                queue.describe_now(everything)
            self._descriptors = merged
            self._started = True
            for queue in self._queues:
                queue.start()

    def adopt_run(self, run: RunInfo) -> None:
        """Export as `run` from now on: every exporter is described again under it, in order with the
        reports (a resumed launch adopting its checkpoint's run id). Exporters that open their run
        once (W&B, OpenTelemetry's resource) keep the first; the Pushgateway moves its group."""
        with self._lock:
            if self._closed:
                raise RuntimeError("ExportHub.adopt_run: the hub is closed")
            self.run = run
            everything = tuple(self._descriptors.values())
            for queue in self._queues:
                queue.put_describe(everything, run)

    def submit(
        self,
        step: int,
        values: ReportValues,
        timestamp: float | None = None,
        *,
        window: ReportValues | None = None,
    ) -> None:
        """Queue one report for every exporter; never blocks on an exporter.

        `timestamp` is Unix seconds at collection (now when None). Counters and histograms are
        running totals; `window` holds what the window itself added (the first delta
        for exporters that prefer deltas). Names not described before are described (as gauges,
        or histograms for histogram values) on each exporter's thread first.
        """
        check_same_process(self._pid, "ExportHub.submit")
        if self._closed:
            if not self._warned_closed_submit:
                self._warned_closed_submit = True
                logger.warning("ExportHub.submit: the hub is closed; reports are ignored")
            return
        if not self._started:
            raise RuntimeError("ExportHub.submit: call describe(descriptors) first")
        values = dict(values)  # a copy: names the hub refuses are dropped from it
        if not values.keys() <= self._descriptors.keys():
            self._describe_new(values)
        timestamp = wall_time() if timestamp is None else timestamp
        for queue in self._queues:
            queue.put_report(step, values, timestamp, window or {})

    def _describe_new(self, values: dict[str, ReportValue]) -> None:
        """Describe names first seen in a report to every exporter; drop (and log once) illegal ones."""
        described = False
        with self._lock:
            for name in [name for name in values if name not in self._descriptors]:
                if name in self._rejected:
                    del values[name]
                    continue
                try:
                    validate_path(name)
                except InvalidMetricNameError as error:
                    logger.error("ExportHub.submit: %s; the value is left out of every report", error)
                    self._rejected.add(name)
                    del values[name]
                    continue
                self._descriptors[name] = _inferred_descriptor(name, values[name])
                described = True
            everything = tuple(self._descriptors.values())
        if described:
            for queue in self._queues:
                queue.put_describe(everything)

    def health(self) -> dict[str, ExporterHealth]:
        """Counters per exporter name."""
        return {queue.name: queue.health() for queue in self._queues}

    def _health_values(self, exporting: str) -> dict[str, ReportValue]:
        """The health values of a report `exporting` is about to export, counting that report as
        exported by it: the report is only seen where it arrived, and the last one of a run must
        not say one fewer than were exported (a closed run showed 89 of 90 forever)."""
        healths = self.health()
        own = healths[exporting]
        healths[exporting] = dataclasses.replace(
            own, exported_reports=own.exported_reports + 1, last_success_timestamp=wall_time()
        )
        return health_values(healths)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export everything queued and flush every exporter, all within one deadline.

        True when every exporter flushed in time.
        """
        check_same_process(self._pid, "ExportHub.force_flush")
        if self._closed or not self._started:
            return not self._closed
        return self._finish(timeout_s, close=False)

    def close(self, timeout_s: float = 10.0) -> None:
        """Export what is queued, then flush and close every exporter, all within one shared deadline.

        An exporter still busy at the deadline is abandoned (its daemon thread
        is left behind and a warning logged), except one that waits for its readers to read the
        final report (`BaseExporter.closing_until()`: the scrape endpoint, at most its `linger_s`),
        waited for until then. A second call only warns.
        """
        check_same_process(self._pid, "ExportHub.close")
        with self._lock:
            if self._closed:
                warn_closed_again("ExportHub.close")
                return
            self._closed = True
        if self._started:
            self._finish(timeout_s, close=True)
            return
        deadline = time.monotonic() + timeout_s
        for queue in self._queues:
            close_exporter(queue.exporter, deadline)

    def _finish(self, timeout_s: float, *, close: bool) -> bool:
        waits = [queue.finish(timeout_s, close=close) for queue in self._queues]
        return all([wait() for wait in waits])


class NullHub:
    """What ranks other than 0 get: every method of `ExportHub`, doing nothing (no thread, no socket)."""

    @property
    def exporters(self) -> list[Exporter]:
        """No exporters."""
        return []

    def describe(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Do nothing."""

    def adopt_run(self, run: RunInfo) -> None:
        """Do nothing."""

    def submit(
        self,
        step: int,
        values: ReportValues,
        timestamp: float | None = None,
        *,
        window: ReportValues | None = None,
    ) -> None:
        """Do nothing."""

    def health(self) -> dict[str, ExporterHealth]:
        """No exporters, no health."""
        return {}

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Nothing to flush."""
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Do nothing."""


def _inferred_descriptor(name: str, value: ReportValue) -> MetricDescriptor:
    if isinstance(value, HistogramValue):
        return MetricDescriptor(name, MetricKind.HISTOGRAM)
    if isinstance(value, Mapping):
        return MetricDescriptor(name, label_name=DEFAULT_LABEL_NAME)
    return MetricDescriptor(name)
