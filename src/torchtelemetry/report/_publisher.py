"""One report per collected window, in step order, with the values logged alongside it."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from torchtelemetry.metric import Metric, MetricKind
from torchtelemetry.report._clock import wall_time
from torchtelemetry.report._flatten import ResultNaming, describe_metrics
from torchtelemetry.report._naming import InvalidMetricNameError, NameCollisionError, sanitize_path
from torchtelemetry.report._ranks import RankSeriesLimit
from torchtelemetry.report._totals import RunningTotals
from torchtelemetry.report._values import MetricDescriptor, ReportValue, ReportValues
from torchtelemetry.report.signals import SignalSet, WindowTiming

__all__ = ["InFlight", "Submit", "WindowPublisher", "describe_with_signals"]

logger = logging.getLogger(__name__)


class Submit(Protocol):
    """Where reports go: `ExportHub.submit`."""

    def __call__(
        self,
        step: int,
        values: ReportValues,
        timestamp: float | None = None,
        *,
        window: ReportValues | None = None,
    ) -> None: ...


def describe_with_signals(
    metrics: Any, signals: SignalSet | None, ranks: RankSeriesLimit
) -> list[MetricDescriptor]:
    """What is exported of the user's metrics and the built-in signals, values per rank within
    `ranks`' limit; a name defined twice raises."""
    described = describe_metrics(metrics)
    builtin = signals.descriptors() if signals is not None else []
    described = ranks.describe(described + builtin)
    seen: dict[str, int] = collections.Counter(d.name for d in described)
    duplicates = sorted(name for name, count in seen.items() if count > 1)
    if duplicates:
        taken = sorted({d.name for d in builtin} & set(duplicates))
        raise ValueError(
            f"Telemetry: metric names {duplicates} are defined twice"
            + (f" ({taken} by the built-in signals)" if taken else "")
            + "; rename yours"
            + (" or pass signals=False" if taken else "")
        )
    return described


class InFlight:
    """A window scheduled and not yet reported: its timing, and whether values logged at its step
    may still come (`release()` says they may not)."""

    __slots__ = ("released", "timing")

    def __init__(self, timing: WindowTiming) -> None:
        self.timing = timing
        self.released = threading.Event()


class WindowPublisher:
    """Turns each collected window into one report for `submit`, in the order windows were scheduled;
    values per rank as `ranks` (the one `describe_with_signals` was given) exports them.

    `publish` runs on the collector's worker thread (windows complete there in order), `scheduled`,
    `log` and `release` on the training thread; one lock orders them. `publish` builds the report
    (the work that grows with the number of metrics) at once, then waits for `release()` before it
    submits it: values `log()`ged while a collection is in flight (a training framework logs right after
    the step that scheduled it) wait for the newest one: those at its step ride in its report, others
    are submitted right after it. A logged name must not be one of the run's own (`descriptors` and
    `reserved`): its value would replace theirs, or theirs its.
    """

    def __init__(
        self,
        leaves: Sequence[tuple[str, Metric]],
        descriptors: Sequence[MetricDescriptor],
        signals: SignalSet | None,
        submit: Submit,
        ranks: RankSeriesLimit,
        *,
        reserved: Collection[str] = (),
    ) -> None:
        self._naming = ResultNaming(leaves)
        self._signals = signals
        self._ranks = ranks
        self._submit = submit
        self._taken = frozenset(d.name for d in descriptors) | frozenset(reserved)
        self.totals = RunningTotals(
            d.name for d in descriptors if d.kind in (MetricKind.COUNTER, MetricKind.HISTOGRAM)
        )
        """Counter and histogram totals across windows (and restarts, through its state_dict)."""
        self._lock = threading.Lock()
        self._in_flight: collections.deque[InFlight] = collections.deque()
        self._logged: dict[int, list[tuple[int, dict[str, ReportValue], float]]] = {}
        self._skipped_names: set[str] = set()
        self.latest: dict[str, ReportValue] = {}
        self.latest_step: int | None = None

    def scheduled(
        self, step: int, *, duration_s: float, steps: int = 0, host: Mapping[str, Any] | None = None
    ) -> InFlight:
        """A window of `steps` steps ending at `step` is being scheduled now, with the signals' `host`
        values; `publish` gets it with its results."""
        timing = WindowTiming(
            step=step, timestamp=wall_time(), duration_s=duration_s, steps=steps, host=host or {}
        )
        window = InFlight(timing)
        with self._lock:
            self._in_flight.append(window)
        return window

    def unscheduled(self, window: InFlight) -> None:
        """The window `scheduled` returned was not scheduled after all."""
        with self._lock:
            self._in_flight.remove(window)

    def release(self) -> None:
        """No more values will be logged at the steps of the collections in flight: they may be submitted."""
        if not self._in_flight:  # every step between windows; only this thread adds to it
            return
        with self._lock:
            for window in self._in_flight:
                if not window.released.is_set():  # set() takes the event's lock: every step, otherwise
                    window.released.set()

    def publish(self, in_flight: InFlight, results: Sequence[Any]) -> None:
        """Build the report of `in_flight` (`results` per leaf); once released, submit it and what
        waited for it."""
        timing = in_flight.timing
        window = self._naming.flatten(results)
        if self._signals is not None:
            self._signals.derive(window, timing)
        self._ranks.derive(window)
        with self._lock:
            reported = self.totals.add(window)
            self.latest = reported
            self.latest_step = timing.step
        in_flight.released.wait()
        with self._lock:
            self._in_flight.remove(in_flight)
            logged = self._logged.pop(timing.step, [])
            riders = [values for step, values, _ in logged if step == timing.step]
            if riders:  # the window's own values win over values logged at its step
                reported = {name: value for values in (*riders, reported) for name, value in values.items()}
            self._submit(timing.step, reported, timing.timestamp, window=window)
            for step, values, timestamp in logged:
                if step != timing.step:
                    self._submit(step, values, timestamp)

    def amend(self, values: Mapping[str, ReportValue]) -> None:
        """Export the latest report again, now, with `values` (of this run's own names, known on this
        host only after its window was scheduled: goodput of a checkpoint marked since, captures its
        verdicts triggered): a gauge in place of its value, a counter's increment added to its total.
        Nothing before the first report, nor while a window is in flight (its report is newer)."""
        with self._lock:
            if not values or self.latest_step is None or self._in_flight:
                return
            self.latest = {**self.latest, **self.totals.add(values)}
            self._submit(self.latest_step, self.latest, wall_time())

    def log(self, values: Mapping[str, ReportValue], step: int) -> None:
        """Submit host values now, or after the newest collection in flight (see the class).

        Raises `NameCollisionError`, submitting none of `values`, when a name (once sanitized)
        is one of the run's own or two names sanitize to one.
        """
        legal = self._legal_names(values)
        taken = sorted(self._taken & legal.keys())
        if taken:
            raise NameCollisionError(
                f"Telemetry.log: {taken} are names of this run's own metrics (the metric tree, the "
                "built-in signals or the exporters' health), whose values they would replace or be "
                "replaced by; log them under names of their own (a prefix such as 'log/'). Nothing "
                "of this call was exported"
            )
        with self._lock:
            if self._in_flight:
                newest = self._in_flight[-1].timing.step
                self._logged.setdefault(newest, []).append((step, legal, wall_time()))
            else:
                self._submit(step, legal, wall_time())

    def _legal_names(self, values: Mapping[str, ReportValue]) -> dict[str, ReportValue]:
        legal: dict[str, ReportValue] = {}
        given: dict[str, list[str]] = collections.defaultdict(list)
        for name, value in values.items():
            try:
                path = sanitize_path(name)
            except InvalidMetricNameError as error:
                if name not in self._skipped_names:
                    self._skipped_names.add(name)
                    logger.warning("Telemetry.log: %r skipped: %s", name, error)
                continue
            legal[path] = value
            given[path].append(name)
        clashes = {path: names for path, names in given.items() if len(names) > 1}
        if clashes:
            raise NameCollisionError(
                "Telemetry.log: names that become one metric path would replace each other: "
                + "; ".join(f"{names} -> {path!r}" for path, names in clashes.items())
                + ". Nothing of this call was exported"
            )
        return legal
