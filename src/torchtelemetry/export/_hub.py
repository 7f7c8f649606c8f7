"""The rank-0 export hub: one thread and one bounded queue per exporter, never blocking the caller.

The façade builds an `ExportHub` on rank 0 and a `NullHub` everywhere else, once;
exporters never check the rank. `submit()` only appends to each exporter's
queue (dropping that queue's oldest report when it is full), so a slow or dead
exporter never stalls training or the other exporters. Errors are counted and
logged once per burst, and the counts travel with every report as the hub's
own health metrics (`exporter/reports`, `exporter/errors`,
`exporter/dropped_reports`, `exporter/last_success_timestamp`, labelled by
exporter name).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchtelemetry.export._base import FailureLog, warn_closed_again
from torchtelemetry.export._protocol import Exporter, ExportResult, RunInfo
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import (
    HistogramValue,
    InvalidMetricNameError,
    MetricDescriptor,
    NameCollisionError,
    Scalars,
    ScalarValue,
    validate_path,
)

__all__ = [
    "DROP_LOG_INTERVAL_S",
    "HEALTH_DESCRIPTORS",
    "HEALTH_PREFIX",
    "ExportHub",
    "ExporterHealth",
    "NullHub",
]

logger = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 60.0
"""Dropped reports are counted every time but logged at most this often per exporter."""

HEALTH_PREFIX = "exporter/"
"""Path prefix of the hub's own health metrics."""

HEALTH_DESCRIPTORS = (
    MetricDescriptor(
        "exporter/reports",
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

    reports_exported: int
    """Reports the exporter accepted (`ExportResult.SUCCESS`)."""
    export_errors: int
    """Exports and describes that failed or raised."""
    dropped_reports: int
    """Reports dropped, oldest first, because the exporter's queue was full (or close ran out of time)."""
    last_success_timestamp: float | None
    """Unix time of the last successful export; None before the first."""


@dataclass(frozen=True, slots=True)
class _Report:
    step: int
    scalars: Scalars
    timestamp: float


@dataclass(frozen=True, slots=True)
class _Describe:
    descriptors: tuple[MetricDescriptor, ...]


class _Barrier:
    """A flush or close request: the worker runs it after everything queued before it."""

    def __init__(self, deadline: float, close: bool) -> None:
        self.deadline = deadline
        self.close = close
        self.ok = False
        self.done = threading.Event()


class _Worker:
    """One exporter's queue, thread, counters and burst-logging state."""

    def __init__(self, exporter: Exporter, queue_size: int, hub: ExportHub) -> None:
        self.exporter = exporter
        self.name = exporter.name
        self._hub = hub
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._items: collections.deque[_Report | _Describe | _Barrier] = collections.deque()
        self._queued_reports = 0
        self._close_deadline: float | None = None
        self._last_drop_log: float | None = None
        self._failures = FailureLog(f"exporter {self.name!r}")
        self.reports_exported = 0
        self.export_errors = 0
        self.dropped_reports = 0
        self.last_success_timestamp: float | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"torchtelemetry-export-{self.name}", daemon=True
        )

    # Caller side.

    def put_report(self, report: _Report) -> None:
        with self._cond:
            if self._queued_reports >= self._queue_size:
                self._drop_oldest_report()
                now = time.monotonic()
                if self._last_drop_log is None or now - self._last_drop_log > DROP_LOG_INTERVAL_S:
                    self._last_drop_log = now
                    logger.warning(
                        "exporter %r: queue full (%d reports), dropping the oldest; %d dropped so far "
                        "(logged at most every %.0f s)",
                        self.name,
                        self._queue_size,
                        self.dropped_reports,
                        DROP_LOG_INTERVAL_S,
                    )
            self._items.append(report)
            self._queued_reports += 1
            self._cond.notify()

    def put(self, item: _Describe | _Barrier) -> None:
        with self._cond:
            if isinstance(item, _Barrier) and item.close:
                self._close_deadline = item.deadline
            self._items.append(item)
            self._cond.notify()

    def health(self) -> ExporterHealth:
        with self._cond:
            return ExporterHealth(
                self.reports_exported, self.export_errors, self.dropped_reports, self.last_success_timestamp
            )

    def _drop_oldest_report(self) -> None:
        for index, item in enumerate(self._items):
            if isinstance(item, _Report):
                del self._items[index]
                self._queued_reports -= 1
                self.dropped_reports += 1
                return

    # Exporter thread.

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
                if isinstance(item, _Report):
                    self._queued_reports -= 1
                    if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                        self.dropped_reports += 1
                        continue
            if isinstance(item, _Report):
                self._export(item)
            elif isinstance(item, _Describe):
                self._describe(item.descriptors)
            else:
                item.ok = self._finish(item)
                item.done.set()
                if item.close:
                    return

    def _export(self, report: _Report) -> None:
        scalars = {**report.scalars, **self._hub.health_scalars()}
        try:
            result = self.exporter.export(report.step, scalars, report.timestamp)
        except Exception as error:
            self._failed(f"export of step {report.step} raised", error)
            return
        if result is ExportResult.SUCCESS:
            self._succeeded()
        else:
            self._failed(f"export of step {report.step} returned {result!r}", None)

    def _describe(self, descriptors: Sequence[MetricDescriptor]) -> None:
        try:
            self.exporter.describe(descriptors, self._hub.run)
        except Exception as error:
            self._failed("describe raised", error)

    def _finish(self, barrier: _Barrier) -> bool:
        try:
            ok = bool(self.exporter.force_flush(max(0.0, barrier.deadline - time.monotonic())))
        except Exception:
            logger.exception("exporter %r: force_flush raised", self.name)
            ok = False
        if barrier.close:
            ok = _close_exporter(self.exporter, barrier.deadline) and ok
        return ok

    def _succeeded(self) -> None:
        with self._cond:
            self.reports_exported += 1
            self.last_success_timestamp = time.time()
        self._failures.succeeded()

    def _failed(self, what: str, error: BaseException | None) -> None:
        with self._cond:
            self.export_errors += 1
        self._failures.failed(what, error)


class ExportHub:
    """Fans reports out to exporters, each on its own named daemon thread with a bounded queue.

    Call `describe()` once the metric tree is known (it raises name collisions
    and illegal names right away and starts the threads), then `submit()` each
    report, and `close()` at the end. Built on rank 0 only; other ranks get a
    `NullHub`.
    """

    def __init__(self, exporters: Sequence[Exporter], *, run: RunInfo, queue_size: int = 8) -> None:
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
        self._workers = [_Worker(exporter, queue_size, self) for exporter in exporters]
        self._lock = threading.Lock()
        self._descriptors: dict[str, MetricDescriptor] = {}
        self._rejected: set[str] = set()
        self._started = False
        self._closed = False
        self._warned_closed_submit = False

    @property
    def exporters(self) -> list[Exporter]:
        """The exporters, in the order given."""
        return [worker.exporter for worker in self._workers]

    def describe(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Describe the metric tree to every exporter (on this thread), then start the exporter threads.

        Raises `InvalidMetricNameError` for an illegal path and what an
        exporter's `describe` raises as `ValueError` (e.g. `NameCollisionError`);
        other errors are logged and counted. Later calls add names and are described on the
        exporters' threads, like names first seen by `submit()`.
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
                for worker in self._workers:
                    worker.put(_Describe(everything))
                return
            for worker in self._workers:
                try:
                    worker.exporter.describe(everything, self.run)
                except ValueError:
                    raise
                except Exception as error:
                    worker._failed("describe raised", error)
            self._descriptors = merged
            self._started = True
            for worker in self._workers:
                worker.thread.start()

    def submit(self, step: int, scalars: Scalars, timestamp: float | None = None) -> None:
        """Queue one report for every exporter; never blocks on an exporter.

        `timestamp` is Unix seconds at collection (now when None). Names not
        described before are described (as gauges, or histograms for histogram
        values) on each exporter's thread first.
        """
        if self._closed:
            if not self._warned_closed_submit:
                self._warned_closed_submit = True
                logger.warning("ExportHub.submit: the hub is closed; reports are ignored")
            return
        if not self._started:
            raise RuntimeError("ExportHub.submit: call describe(descriptors) first")
        values = dict(scalars)
        if any(name not in self._descriptors for name in values):
            self._describe_new(values)
        report = _Report(step, values, time.time() if timestamp is None else timestamp)
        for worker in self._workers:
            worker.put_report(report)

    def _describe_new(self, values: dict[str, ScalarValue]) -> None:
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
            for worker in self._workers:
                worker.put(_Describe(everything))

    def health(self) -> dict[str, ExporterHealth]:
        """Counters per exporter name."""
        return {worker.name: worker.health() for worker in self._workers}

    def health_scalars(self) -> dict[str, ScalarValue]:
        """The health metrics as report values (one value per exporter name)."""
        healths = self.health()
        scalars: dict[str, ScalarValue] = {
            "exporter/reports": {name: float(h.reports_exported) for name, h in healths.items()},
            "exporter/errors": {name: float(h.export_errors) for name, h in healths.items()},
            "exporter/dropped_reports": {name: float(h.dropped_reports) for name, h in healths.items()},
        }
        last_success = {
            name: h.last_success_timestamp
            for name, h in healths.items()
            if h.last_success_timestamp is not None
        }
        if last_success:
            scalars["exporter/last_success_timestamp"] = last_success
        return scalars

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export everything queued and flush every exporter, all within one deadline.

        True when every exporter flushed in time.
        """
        if self._closed or not self._started:
            return not self._closed
        return self._barrier(timeout_s, close=False)

    def close(self, timeout_s: float = 10.0) -> None:
        """Export what is queued, then flush and close every exporter, all within one shared deadline.

        An exporter still busy at the deadline is abandoned (its daemon thread
        is left behind and a warning logged). A second call only warns.
        """
        with self._lock:
            if self._closed:
                warn_closed_again("ExportHub.close")
                return
            self._closed = True
        if self._started:
            self._barrier(timeout_s, close=True)
            return
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            _close_exporter(worker.exporter, deadline)

    def _barrier(self, timeout_s: float, *, close: bool) -> bool:
        deadline = time.monotonic() + timeout_s
        barriers = [_Barrier(deadline, close) for _ in self._workers]
        for worker, barrier in zip(self._workers, barriers, strict=True):
            worker.put(barrier)
        ok = True
        for worker, barrier in zip(self._workers, barriers, strict=True):
            if not barrier.done.wait(max(0.0, deadline - time.monotonic())):
                logger.warning(
                    "exporter %r: %s did not finish within %.1f s%s",
                    worker.name,
                    "close" if close else "force_flush",
                    timeout_s,
                    "; abandoning its thread" if close else "",
                )
                ok = False
                continue
            ok = ok and barrier.ok
            if close:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        return ok


class NullHub:
    """What ranks other than 0 get: every method of `ExportHub`, doing nothing (no thread, no socket)."""

    @property
    def exporters(self) -> list[Exporter]:
        """No exporters."""
        return []

    def describe(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Do nothing."""

    def submit(self, step: int, scalars: Scalars, timestamp: float | None = None) -> None:
        """Do nothing."""

    def health(self) -> dict[str, ExporterHealth]:
        """No exporters, no health."""
        return {}

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Nothing to flush."""
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Do nothing."""


def _inferred_descriptor(name: str, value: ScalarValue) -> MetricDescriptor:
    if isinstance(value, HistogramValue):
        return MetricDescriptor(name, MetricKind.HISTOGRAM)
    if isinstance(value, Mapping):
        return MetricDescriptor(name, label_name="label")
    return MetricDescriptor(name)


def _close_exporter(exporter: Exporter, deadline: float) -> bool:
    try:
        exporter.close(max(0.0, deadline - time.monotonic()))
    except Exception:
        logger.exception("exporter %r: close raised", exporter.name)
        return False
    return True
