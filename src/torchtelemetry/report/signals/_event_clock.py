"""`EventClock`: device time of each phase section, from CUDA timing events read off the training
thread.

The event clock records two events on the current stream per section (no sync); a reader thread
waits for each batch's events to complete and reads their elapsed times, so a window carries the
batches read by the time it was scheduled, usually those of the window before (`take(wait=True)`
waits for all of them: at a checkpoint and at close). With traces on, the reader places the events'
times on the host timeline (`HostAnchor`) for the window's `SectionLog`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchtelemetry.report.signals._clock import Batch
from torchtelemetry.report.signals._timeline import NO_SECTIONS, HostAnchor, LateSections, SectionLog

__all__ = ["EventClock"]

logger = logging.getLogger(__name__)


class EventClock:
    """Device time of each section: a pair of timing events on the current stream, read by a daemon
    thread (`torchtelemetry-phase-reader`) once they completed; events are pooled and reused.

    `make_event` builds an event with `record()`, `synchronize()` and `elapsed_time(end)` in
    milliseconds (default: a CUDA timing event whose `synchronize()` yields the CPU). When `log` keeps
    sections, the reader places each batch's events on the host timeline (`HostAnchor`) and hands
    them to the window they were timed in.
    """

    def __init__(
        self,
        phases: int,
        device: torch.device,
        make_event: Callable[[], Any] | None = None,
        log: SectionLog = NO_SECTIONS,
    ) -> None:
        self._phases = phases
        self._device = device
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True, blocking=True))
        self._log = log
        self._pool: collections.deque[Any] = collections.deque()
        self._sections: list[tuple[int, Any, Any]] = []
        self._batches: collections.deque[
            tuple[list[tuple[int, Any, Any]], int, LateSections | None] | None
        ] = collections.deque()
        self._read: list[Batch] = []
        self._unread = 0
        self._changed = threading.Condition()
        self._reader: threading.Thread | None = None
        self._failed = False

    def _event(self) -> Any:
        try:
            return self._pool.pop()
        except IndexError:
            return self._make_event()

    def start(self) -> tuple[float, Any]:
        event = self._event()
        event.record()
        return time.perf_counter(), event

    def stop(self, index: int, started: tuple[float, Any]) -> None:
        event = self._event()
        event.record()
        self._sections.append((index, started[1], event))

    def entered_at(self, started: tuple[float, Any]) -> float:
        return started[0]

    def take(self, steps: int, *, wait: bool = False, timeout_s: float = 60.0) -> list[Batch]:
        """Hand the sections since the last call to the reader; return the batches it has read
        (all of them with `wait`, up to `timeout_s`)."""
        sections, self._sections = self._sections, []
        with self._changed:
            if sections or steps:
                self._start_reader()
                self._batches.append((sections, steps, self._log.late() if sections else None))
                self._unread += 1
                self._changed.notify_all()
            if wait and not self._changed.wait_for(lambda: self._unread == 0, timeout_s):
                logger.warning(
                    "Telemetry: phase events not completed after %.0f s; their times come with a "
                    "later window",
                    timeout_s,
                )
            read, self._read = self._read, []
        return read

    def _start_reader(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._run, name="torchtelemetry-phase-reader", daemon=True)
            self._reader.start()

    def _run(self) -> None:
        stream = None
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            stream = torch.cuda.Stream(self._device)  # idle: an anchor recorded there completes at once
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._batches))
                batch = self._batches.popleft()
            if batch is None:
                return
            sections, steps, late = batch
            seconds = [0.0] * self._phases
            try:
                for index, started, ended in sections:
                    ended.synchronize()
                    seconds[index] += started.elapsed_time(ended) / 1000
                if late is not None:
                    anchor = HostAnchor(self._event(), stream)
                    for index, started, ended in sections:
                        late.add(index, anchor.place(started), anchor.place(ended))
                    self._pool.append(anchor.event)
            except RuntimeError as error:  # a failed device: the training thread hears of it
                if not self._failed:
                    self._failed = True
                    logger.warning("Telemetry: phase events could not be read: %s", error)
            for _, started, ended in sections:
                self._pool.extend((started, ended))
            if late is not None:
                late.finish()
            with self._changed:
                self._read.append((seconds, steps))
                self._unread -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Stop the reader once it has read what it was given (bounded)."""
        if self._reader is None:
            return
        with self._changed:
            self._batches.append(None)
            self._changed.notify_all()
        self._reader.join(timeout=60.0)
