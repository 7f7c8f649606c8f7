"""`ExporterQueue`: one exporter's bounded queue, its thread, and its health counters.

The caller side never blocks on the exporter: a full queue drops its oldest report, one of values
only logged (no window of metrics in it) while one is queued. The
exporter's thread exports, describes, flushes and closes in queue order and counts what
succeeded and failed: the queue is the one owner of an exporter's health. A failure the exporter
reports (`ExportResult.FAILURE`) is only counted here, since the exporter logs it with its reason
(the `Exporter` protocol; `BaseExporter` does); what the exporter raises instead (anything, even
`SystemExit` or `KeyboardInterrupt`) or returns that is not an `ExportResult` is logged here, once
per burst: the thread outlives every exporter, so exported + errors + dropped always adds up to
the reports submitted.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchtelemetry.export._base import BaseExporter, FailureLog, LogThrottle
from torchtelemetry.export._health import ExporterHealth
from torchtelemetry.export._protocol import Exporter, ExporterStartError, ExportResult, RunInfo
from torchtelemetry.export._temporality import DeltaConverter, preferred_temporality
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = ["DROP_LOG_INTERVAL_S", "ExporterQueue", "close_exporter"]

logger = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 60.0
"""Dropped reports are counted every time but logged at most this often per exporter."""


@dataclass(frozen=True, slots=True)
class _Report:
    step: int
    values: ReportValues
    timestamp: float
    window: ReportValues


@dataclass(frozen=True, slots=True)
class _Describe:
    descriptors: tuple[MetricDescriptor, ...]
    run: RunInfo | None = None


class _Barrier:
    """A flush or close request: the thread runs it after everything queued before it."""

    def __init__(self, deadline: float, close: bool) -> None:
        self.deadline = deadline
        self.close = close
        self.ok = False
        self.done = threading.Event()


class ExporterQueue:
    """One exporter behind a bounded queue, exported on its own named daemon thread.

    `extra_values(name)` is called on the thread before each export, with this exporter's name;
    its values (the hub's health metrics) join the report. Counters and histograms reach the
    exporter in the temporality it prefers (`preferred_temporality`; a bad declaration raises
    `ValueError` here).
    """

    def __init__(
        self,
        exporter: Exporter,
        *,
        run: RunInfo,
        queue_size: int,
        extra_values: Callable[[str], ReportValues] = lambda name: {},
    ) -> None:
        self.exporter = exporter
        self.name = exporter.name
        self._run = run
        self._extra_values = extra_values
        self._converter = DeltaConverter(preferred_temporality(exporter))
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._items: collections.deque[_Report | _Describe | _Barrier] = collections.deque()
        self._queued_reports = 0
        self._window_names: frozenset[str] = frozenset()
        """The names of the window in the last window report exported (its `window`'s)."""
        self._close_deadline: float | None = None
        self._drop_log = LogThrottle(DROP_LOG_INTERVAL_S)
        self._failures = FailureLog(f"exporter {self.name!r}")
        self._exported_reports = 0
        self._errors = 0
        self._dropped_reports = 0
        self._last_success_timestamp: float | None = None
        self._thread = threading.Thread(
            target=self._run_items, name=f"torchtelemetry-export-{self.name}", daemon=True
        )

    # -- caller side ------------------------------------------------------------------------

    def describe_now(self, descriptors: Sequence[MetricDescriptor]) -> None:
        """Describe on the caller's thread, before `start()`; `ValueError` and `ExporterStartError`
        propagate, the rest is counted."""
        self._converter.learn(descriptors)
        try:
            self.exporter.describe(descriptors, self._run)
        except (ValueError, ExporterStartError):
            raise
        except Exception as error:
            self._failed("describe raised", error)

    def start(self) -> None:
        """Start the exporter's thread."""
        self._thread.start()

    def put_report(self, step: int, values: ReportValues, timestamp: float, window: ReportValues) -> None:
        """Queue a report; when the queue is full, drop (and count) a queued report first: the oldest
        that carries no window (values only logged), else the oldest.

        `window` holds the window's own values (empty for a report of logged values only); the
        names `values` carries as running totals take their first delta after a start from it.
        """
        with self._cond:
            if self._queued_reports >= self._queue_size:
                self._drop_oldest_report()
                if self._drop_log.due():
                    logger.warning(
                        "exporter %r: queue full (%d reports), dropping the oldest (of logged values "
                        "only, while one is queued); %d dropped so far "
                        "(logged at most every %.0f s)",
                        self.name,
                        self._queue_size,
                        self._dropped_reports,
                        DROP_LOG_INTERVAL_S,
                    )
            self._items.append(_Report(step, values, timestamp, window))
            self._queued_reports += 1
            self._cond.notify()

    def put_describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo | None = None) -> None:
        """Queue a describe (of every name known so far; under `run` from then on, if given), run on
        the exporter's thread."""
        self._put(_Describe(tuple(descriptors), run))

    def finish(self, timeout_s: float, *, close: bool) -> Callable[[], bool]:
        """Queue a flush (and a close, if `close`) after what is queued; returns its `wait`.

        The returned function waits at most `timeout_s` from now and returns True when the
        exporter flushed in time; a close waits longer while the exporter says it is waiting for
        its readers (`BaseExporter.closing_until()`: the scrape endpoint waiting for the final
        scrape). A close still running at its deadline abandons the thread (a warning says so).
        Queue every exporter's finish before waiting for any of them.
        """
        barrier = _Barrier(time.monotonic() + timeout_s, close)
        self._put(barrier)

        def wait() -> bool:
            deadline = barrier.deadline
            while not barrier.done.wait(max(0.0, deadline - time.monotonic())):
                extended = _closing_until(self.exporter) if close else None
                if extended is None or extended <= deadline:
                    logger.warning(
                        "exporter %r: %s did not finish within %.1f s%s",
                        self.name,
                        "close" if close else "force_flush",
                        timeout_s,
                        "; abandoning its thread" if close else "",
                    )
                    return False
                deadline = extended
            if close:
                self._thread.join(max(0.0, deadline - time.monotonic()))
            return barrier.ok

        return wait

    def health(self) -> ExporterHealth:
        """The exporter's counters now."""
        with self._cond:
            return ExporterHealth(
                self._exported_reports, self._errors, self._dropped_reports, self._last_success_timestamp
            )

    def _put(self, item: _Describe | _Barrier) -> None:
        with self._cond:
            if isinstance(item, _Barrier) and item.close:
                self._close_deadline = item.deadline
            self._items.append(item)
            self._cond.notify()

    def _drop_oldest_report(self) -> None:
        """Drop the oldest report of values only logged (no window of metrics in it), else the oldest:
        a burst of per-step logs never pushes out a window's metrics while logs remain to drop."""
        reports = [(index, item) for index, item in enumerate(self._items) if isinstance(item, _Report)]
        index = next((index for index, report in reports if not report.window), reports[0][0])
        del self._items[index]
        self._queued_reports -= 1
        self._dropped_reports += 1

    # -- the exporter's thread --------------------------------------------------------------

    def _run_items(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
                if isinstance(item, _Report):
                    self._queued_reports -= 1
                    if self._close_deadline is not None and time.monotonic() > self._close_deadline:
                        self._dropped_reports += 1
                        continue
            if isinstance(item, _Report):
                self._export(item)
            elif isinstance(item, _Describe):
                self._run = item.run or self._run
                self._converter.learn(item.descriptors)
                try:
                    self.exporter.describe(item.descriptors, self._run)
                except BaseException as error:  # an exporter never ends its thread, not even by SystemExit
                    self._failed("describe raised", error)
            else:
                item.ok = self._finish(item)
                item.done.set()
                if item.close:
                    return

    def _export(self, report: _Report) -> None:
        if report.window:  # a window report: the names an older window had and this one lacks go
            retired = self._window_names - report.window.keys()
            self._window_names = frozenset(report.window)
            if retired:
                _retire(self.exporter, retired)
        values = self._converter.convert({**report.values, **self._extra_values(self.name)}, report.window)
        try:
            result = self.exporter.export(report.step, values, report.timestamp)
        except BaseException as error:  # an exporter never ends its thread, not even by SystemExit
            self._failed(f"export of step {report.step} raised", error)
            return
        if result is ExportResult.SUCCESS:
            self._converter.accepted()
            with self._cond:
                self._exported_reports += 1
                self._last_success_timestamp = wall_time()
            self._failures.succeeded()
        elif result is ExportResult.FAILURE:
            self._count_error()  # the exporter logged why: it reports failure instead of raising
        else:
            self._failed(f"export of step {report.step} returned {result!r}, not an ExportResult")

    def _finish(self, barrier: _Barrier) -> bool:
        try:
            ok = bool(self.exporter.force_flush(max(0.0, barrier.deadline - time.monotonic())))
        except BaseException:  # an exporter never ends its thread, not even by SystemExit
            logger.exception("exporter %r: force_flush raised", self.name)
            ok = False
        if barrier.close:
            try:
                ok = close_exporter(self.exporter, barrier.deadline) and ok
            except (
                BaseException
            ):  # what close_exporter leaves to its caller's thread: SystemExit and the like
                logger.exception("exporter %r: close raised", self.name)
                ok = False
        return ok

    def _failed(self, what: str, error: BaseException | None = None) -> None:
        """Count and log (once per burst) what the exporter raised instead of reporting."""
        self._count_error()
        self._failures.failed(what, error)

    def _count_error(self) -> None:
        with self._cond:
            self._errors += 1


def _retire(exporter: Exporter, names: frozenset[str]) -> None:
    """A `BaseExporter`'s `retire(names)` (any other exporter gets each report as it is); logged if it
    raised."""
    if not isinstance(exporter, BaseExporter):
        return
    try:
        exporter.retire(names)
    except Exception:
        logger.exception("exporter %r: retire raised", exporter.name)


def _closing_until(exporter: Exporter) -> float | None:
    """A `BaseExporter`'s `closing_until()`: while its close waits for its readers, the
    `time.monotonic()` by which it returns (None for any other exporter)."""
    if not isinstance(exporter, BaseExporter):
        return None
    try:
        return exporter.closing_until()
    except Exception:
        logger.exception("exporter %r: closing_until raised", exporter.name)
        return None


def close_exporter(exporter: Exporter, deadline: float) -> bool:
    """`exporter.close()` with the time left until `deadline`; False (logged) if it raised."""
    try:
        exporter.close(max(0.0, deadline - time.monotonic()))
    except Exception:
        logger.exception("exporter %r: close raised", exporter.name)
        return False
    return True
