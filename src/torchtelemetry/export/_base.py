"""`BaseExporter`: the lifecycle every exporter shares, so a backend module holds only its backend.

The base owns the name, the lock, start-once, close-once, the export-after-close
check, the second-close warning and failure logging (once per burst, with the reason). It counts
nothing: the hub's `ExporterQueue` counts every exporter's reports and errors, so each is counted
once. A subclass implements small hooks:

- `_describe(descriptors, run)`: learn the names (may raise `ValueError`, e.g. `NameCollisionError`);
- `_start(run)`: open the port / file / client, once, after the first `_describe` (a start that
  fails should log and leave `_export` to raise `ExportFailed`, or raise `ExporterStartError`
  when the run must not go on without it, e.g. a port in use);
- `_export(step, values, timestamp)`: publish one report; raise `ExportFailed` (or any error) on failure;
- `_flush(timeout_s) -> bool`: deliver what is buffered (only once started);
- `_close(timeout_s)`: release what the exporter opened (called once, started or not).

An exporter that serves values across reports (a scrape endpoint, a Pushgateway group) overrides
`_retire(names)`: names a window report carried and a later one leaves out, no longer served.

`destination()` says where the reports go (the start-up line names it). An exporter whose readers
pull (a scrape endpoint) overrides `closing_until()`: while its close
waits for them to read the final report, the time it returns by, so the hub waits for it.

Every hook runs under the exporter's lock, one at a time. `Exporter` stays the extension point:
an exporter may implement that Protocol directly instead.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import ClassVar

from torchtelemetry._process import check_same_process, current_pid
from torchtelemetry.export._protocol import ExportResult, RunInfo
from torchtelemetry.export._temporality import Temporality
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import MetricDescriptor, ReportValues

__all__ = ["BaseExporter", "ExportFailed", "FailureLog", "warn_closed_again"]

logger = logging.getLogger(__name__)


def warn_closed_again(owner: str) -> None:
    """The warning a second `close()` gives, for the hub and every exporter alike."""
    warnings.warn(f"{owner}: already closed", RuntimeWarning, stacklevel=3)


class ExportFailed(Exception):
    """Raised by an exporter's hooks for a failure with a known reason; logged without a traceback.

    Chain the underlying error (`raise ExportFailed("push failed") from error`) to log its text too.
    """


class FailureLog:
    """Logs the first failure of a burst with its reason and only counts the rest; a success ends the burst.

    Used by one thread at a time (an exporter's hub thread).
    """

    def __init__(self, subject: str, log: logging.Logger = logger) -> None:
        self.subject = subject
        self._log = log
        self._in_burst = 0

    def failed(self, what: str, error: BaseException | None = None) -> None:
        """Record one failure; log it if it starts a burst."""
        self._in_burst += 1
        if self._in_burst == 1:
            reason = f": {type(error).__name__}: {error}" if error is not None else ""
            self._log.error(
                "%s: %s%s; further failures are counted, not logged, until one succeeds",
                self.subject,
                what,
                reason,
                exc_info=error if error is not None and not isinstance(error, OSError) else None,
            )

    def succeeded(self) -> None:
        """End the current burst, if any."""
        if self._in_burst:
            self._log.info("%s: recovered after %d failures", self.subject, self._in_burst)
            self._in_burst = 0


class LogThrottle:
    """Says when to log an event that can repeat fast: at most once every `interval_s` seconds."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: float | None = None

    def due(self) -> bool:
        """True (and the clock restarts) when `interval_s` has passed since the last True, or never was."""
        now = time.monotonic()
        if self._last is not None and now - self._last <= self.interval_s:
            return False
        self._last = now
        return True


class BaseExporter:
    """An `Exporter` whose lifecycle is done: subclasses implement the `_describe` ... `_close` hooks.

    After construction nothing raises but `describe` (with `ValueError` for names the
    backend cannot take, `ExporterStartError` for a backend that cannot start as
    configured): failures are logged once per burst and reported as
    `ExportResult.FAILURE` or a False flush. Used in a forked child (its lock, threads and
    sockets stay with the parent), every method raises a `RuntimeError` naming the fork.
    """

    preferred_temporality: ClassVar[Mapping[MetricKind, Temporality]] = {}
    """Kinds the exporter wants as deltas (`{MetricKind.HISTOGRAM: Temporality.DELTA}`); running
    totals for the kinds not named."""

    def __init__(self, name: str, *, subject: str | None = None) -> None:
        self.name = name
        """Short name used in logs and in the hub's health metrics."""
        self._lock = threading.RLock()
        self._pid = current_pid()
        self._started = False
        self._closed = False
        self._failures = FailureLog(
            subject or f"{type(self).__name__} {name!r}", logging.getLogger(type(self).__module__)
        )

    @property
    def closed(self) -> bool:
        """True once `close()` was called."""
        return self._closed

    # -- Exporter protocol (final) ----------------------------------------------------------

    def describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Learn the run and the names; the first call also starts the backend."""
        check_same_process(self._pid, f"{type(self).__name__}.describe")
        with self._lock:
            if self._closed:
                self._failures.failed("describe() after close() ignored")
                return
            self._describe(descriptors, run)
            if not self._started:
                self._started = True  # once: a backend that failed to start reports it on each export
                self._start(run)

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        """Publish one report; FAILURE (logged once per burst) instead of raising."""
        check_same_process(self._pid, f"{type(self).__name__}.export")
        with self._lock:
            if self._closed:
                return self._failed("export() after close()")
            if not self._started:
                return self._failed("export() before describe()")
            try:
                self._export(step, values, timestamp)
            except ExportFailed as failure:
                return self._failed(f"step {step}: {failure}", failure.__cause__)
            except Exception as error:
                return self._failed(f"step {step}: export failed", error)
            self._failures.succeeded()
            return ExportResult.SUCCESS

    def retire(self, names: frozenset[str]) -> None:
        """Stop serving `names` from the next report on: a window report carried them and the newer
        one about to be exported does not (that window has no value for them). The hub's queue calls
        it on the export thread, before that report's `export`."""
        check_same_process(self._pid, f"{type(self).__name__}.retire")
        with self._lock:
            if self._started and not self._closed:
                self._retire(names)

    def _retire(self, names: frozenset[str]) -> None:
        """Forget `names`' values; nothing to do (the default) for an exporter that sends each report
        as it is."""

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Deliver anything buffered; True when everything was delivered in time (False once closed)."""
        check_same_process(self._pid, f"{type(self).__name__}.force_flush")
        with self._lock:
            if self._closed:
                return False
            return not self._started or self._guarded_flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, then release the backend, within one deadline; a second call only warns."""
        check_same_process(self._pid, f"{type(self).__name__}.close")
        with self._lock:
            if self._closed:
                warn_closed_again(self._failures.subject)
                return
            self._closed = True
            deadline = time.monotonic() + timeout_s
            if self._started:
                self._guarded_flush(timeout_s)
            try:
                self._close(max(0.0, deadline - time.monotonic()))
            except Exception as error:
                self._failures.failed("close failed", error)

    def closing_until(self) -> float | None:
        """The `time.monotonic()` by which `close()`, running or called now, returns after waiting
        for readers that pull (a scrape endpoint's final scrape); the hub's close waits that long
        for it, past its own deadline. None (the default): close is bounded by its `timeout_s`.
        Called from any thread, without the exporter's lock."""
        return None

    def destination(self) -> str | None:
        """Where the reports go (a URL with its secrets masked, a file, a directory), for the line a
        `Telemetry` prints at start-up; None (the default): the exporter's name says it all."""
        return None

    # -- hooks ------------------------------------------------------------------------------

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Learn the names; raise `ValueError` for names the backend cannot take. Default: nothing."""

    def _start(self, run: RunInfo) -> None:
        """Open the backend (port, file, client); called once, after the first `_describe`."""

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Publish one report; raise `ExportFailed` (or any error) when it was not published."""
        raise NotImplementedError(f"{type(self).__name__} must implement _export()")

    def _flush(self, timeout_s: float) -> bool:
        """Deliver anything buffered; True when nothing is left undelivered. Default: nothing buffered."""
        return True

    def _close(self, timeout_s: float) -> None:
        """Release what the exporter opened (after the final flush; also when never started)."""

    # -- internals --------------------------------------------------------------------------

    def _failed(self, what: str, error: BaseException | None = None) -> ExportResult:
        self._failures.failed(what, error)
        return ExportResult.FAILURE

    def _guarded_flush(self, timeout_s: float) -> bool:
        try:
            if self._flush(timeout_s):
                return True
        except ExportFailed as failure:
            self._failed(f"flush: {failure}", failure.__cause__)
            return False
        except Exception as error:
            self._failed("flush failed", error)
            return False
        return False
