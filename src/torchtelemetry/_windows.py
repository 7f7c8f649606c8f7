"""Window bookkeeping: the steps of the window being collected, when the next is due, scheduling it
and collecting the ones that finished.

A collection is due every `every` steps on a grid that extra collections (a flush, a checkpoint,
a training framework's own logging) do not move. Scheduling never waits unless `max_pending`
collections are already in flight; then it waits for the oldest (every rank schedules the same
collections, so none can be skipped on one rank alone). A failed collection stops the bookkeeping.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from torchtelemetry.collect import AsyncMetricCollector, CollectionError
from torchtelemetry.report import COLLECT_PHASE, SectionLog, SignalSet, WindowPublisher
from torchtelemetry.run import Heartbeat

__all__ = ["StepWindows"]

logger = logging.getLogger(__name__)


class StepWindows:
    """One `Telemetry`'s windows, on the training thread: `stepped` after every step, `schedule` and
    `drain` for the extra collections, `state` / `load` for checkpoints, `closing` at close. It is
    the one writer of the hang heartbeat `beat` (None: hang detection off): where the training
    thread is, as these calls tell it."""

    def __init__(
        self,
        collector: AsyncMetricCollector,
        publisher: WindowPublisher,
        signals: SignalSet | None,
        *,
        every: int,
        beat: Heartbeat | None,
        sections: SectionLog | None = None,
    ) -> None:
        """`sections`: the window's timeline for its trace (each step's end, each wait for a
        collection); None: traces are off."""
        self._collector = collector
        self._publisher = publisher
        self._signals = signals
        self._every = every
        self.steps_in_window = 0
        """Steps since the last collection: the window that would be scheduled now."""
        self._steps_since_grid = 0
        self.last_step: int | None = None
        """The last step marked (None before the first)."""
        self._last_step_clock: float | None = None
        self._window_start = self._signals_flushed = time.perf_counter()
        self.backpressure_waits = 0
        """Times scheduling waited because `max_pending` collections were in flight."""
        self.failure: CollectionError | None = None
        """The collection that failed; nothing more is collected after it."""
        self._ignored_inputs = False
        self._beat = beat
        self._sections = sections
        self._collect_kind = sections.kind(COLLECT_PHASE) if sections is not None else 0

    def stepped(self, step: int, inputs: Mapping[str, Any]) -> None:
        """Step `step` ended (`inputs`: its `step()` keywords): collect what finished, schedule if due."""
        now = time.perf_counter()
        if self._signals is not None:
            step_time = None if self._last_step_clock is None else now - self._last_step_clock
            self._signals.record_step(step, step_time, inputs)
        elif not self._ignored_inputs and (
            given := sorted(keyword for keyword, value in inputs.items() if value is not None)
        ):
            self._ignored_inputs = True
            logger.warning(
                "Telemetry.step: signals are off (TelemetryConfig.signals=False), so %s are not "
                "recorded (logged once)",
                given,
            )
        if self._sections is not None:
            self._sections.stepped(step, now)
        self._last_step_clock = now
        self.last_step = step
        if self._beat is not None:
            self._beat.step = step + 1
        self.steps_in_window += 1
        self._steps_since_grid += 1
        self.drain(block=False)
        if self._steps_since_grid >= self._every:
            self._steps_since_grid = 0
            self.schedule()  # applies the step's staged updates before its snapshot
        else:
            self._collector.apply_staged()

    def flush_signals(self, *, final: bool = False) -> float:
        """Let the signals account for the time since they were last flushed; returns now."""
        now = time.perf_counter()
        if self._signals is not None:
            self._signals.flush(now - self._signals_flushed, final=final)
        self._signals_flushed = now
        return now

    def schedule(self, *, final: bool = False) -> None:
        """Schedule the current window; wait for the oldest only when the collector's ring is full."""
        if self._collector.pending >= self._collector.max_pending:
            self.backpressure_waits += 1
            self.drain(block=True, limit=1)
        now = self.flush_signals(final=final)
        window = self._publisher.scheduled(
            self.last_step or 0,
            duration_s=now - self._window_start,
            steps=self.steps_in_window,
            host=self._signals.host_values() if self._signals is not None else None,
        )
        try:
            # The report is built on the collector's worker thread (naming, totals: work that grows
            # with the number of metrics); this thread only collects that it was done.
            self._collector.schedule_collection(
                step=self.last_step, then=functools.partial(self._publisher.publish, window)
            )
        except BaseException:
            self._publisher.unscheduled(window)
            raise
        self._window_start = now
        self.steps_in_window = 0

    def drain(self, *, block: bool, limit: int | None = None) -> None:
        """Collect the windows that finished (all in flight if `block`, at most `limit`)."""
        # Values logged at the windows' steps came before this call (a framework logs right after
        # the step()): their reports may be submitted now.
        self._publisher.release()
        if not self._collector.pending:
            return
        if not block:
            self._collect(block=block, limit=limit)
            return
        beat = self._beat
        if beat is not None:
            beat.collecting = True
            beat.collections += 1
        started = time.perf_counter()
        try:
            self._collect(block=block, limit=limit)
        finally:
            if beat is not None:
                beat.collecting = False
            if self._sections is not None:
                self._sections.record(self._collect_kind, started, time.perf_counter())

    def _collect(self, *, block: bool, limit: int | None) -> None:
        collected = 0
        while self._collector.pending and (block or self._collector.ready()):
            if limit is not None and collected >= limit:
                return
            try:
                self._collector.collect_results()
            except CollectionError as error:
                self.failure = error
                raise
            collected += 1

    def state(self) -> dict[str, int]:
        """The bookkeeping a checkpoint keeps: the last step, the steps of the current window and since
        the last every-`every` collection."""
        return {
            "step": -1 if self.last_step is None else self.last_step,
            "steps_in_window": self.steps_in_window,
            "steps_since_grid": self._steps_since_grid,
        }

    def load(self, state: Mapping[str, Any]) -> None:
        """Restore what `state()` returned."""
        step = int(state.get("step", -1))
        self.last_step = None if step < 0 else step
        if self._beat is not None:
            self._beat.step = step + 1
        self.steps_in_window = int(state.get("steps_in_window", 0))
        self._steps_since_grid = int(state.get("steps_since_grid", self.steps_in_window))

    def closing(self) -> None:
        """The training thread left the loop: `close()` began (the heartbeat's phase "closed")."""
        if self._beat is not None:
            self._beat.closed = True
