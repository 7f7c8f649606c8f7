"""Which verdicts become captures (the exporting rank's `CaptureDesk`) and what the reports say of
them (every rank's `CaptureLedger`) (docs/signals.md, Captures).

A verdict triggers once, when it first names its rank, and again only after it cleared (a window
that no longer names it); a request triggers each time; a hang capture the hang monitor learned of
triggers once. Every trigger is counted; the first `max_captures` of the run become orders, sent one
at a time: the next leaves with a window only once every rank the last one named settled it (written
or failed), so a rank never has two at once. The ledger reads only what windows carried, so every
rank reports the same: the counts, the latest capture's rank and step from the window it began with,
and its directory from then on, unless the rank it named reports it failed. Nothing here reads a
clock, a file or a collective: tests feed verdicts and windows.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from torchtelemetry.report import CaptureOrder, CaptureOutcomes, CaptureReport, CaptureWindow, Verdict

__all__ = ["CaptureDesk", "CaptureLedger"]

logger = logging.getLogger(__name__)


class CaptureDesk:
    """The exporting rank's decisions over `triggers` (`TelemetryConfig.capture_on`), at most
    `max_captures` captures per run; thread-safe (verdicts and outcomes come from the publishing
    thread, requests from any, hang captures from the hang monitor, windows leave from the training
    thread)."""

    def __init__(self, triggers: Collection[str], max_captures: int) -> None:
        self._triggers = frozenset(triggers)
        self._max = max_captures
        self._lock = threading.Lock()
        self._active: set[tuple[str, int]] = set()
        self._queue: deque[CaptureOrder] = deque()
        self._roles = 0
        """Ranks still to settle the order sent last (0: none waits)."""
        self._counts: dict[str, int] = {}
        self._hangs: deque[tuple[int, int]] = deque()
        self._hangs_seen: set[tuple[int, int]] = set()
        self.ordered = 0
        """Captures ordered in this run (checkpointed: the bound is the run's)."""
        self._told_bound = False

    def judge(self, verdicts: Sequence[Verdict]) -> None:
        """One window's verdicts: those new since the last window trigger."""
        with self._lock:
            named = {(v.trigger, v.rank): v for v in verdicts if v.trigger in self._triggers}
            for key, verdict in named.items():
                if key not in self._active:
                    self._trigger(
                        CaptureOrder(verdict.rank, verdict.reference, verdict.trigger, verdict.trigger)
                    )
            self._active = set(named)

    def request(self, rank: int, reason: str) -> None:
        """The user's request of a capture on `rank`, its directory ending in `reason`."""
        with self._lock:
            self._trigger(CaptureOrder(rank, None, "request", reason))

    def hang_captured(self, rank: int, step: int) -> bool:
        """The rank a hang names wrote its stacks to a capture at `step`; False if known already."""
        with self._lock:
            if (rank, step) in self._hangs_seen:
                return False
            self._hangs_seen.add((rank, step))
            self._hangs.append((rank, step))
            self._counts["hang"] = self._counts.get("hang", 0) + 1
            return True

    def _trigger(self, order: CaptureOrder) -> None:
        self._counts[order.trigger] = self._counts.get(order.trigger, 0) + 1
        if self.ordered >= self._max:
            if not self._told_bound:
                self._told_bound = True
                logger.warning(
                    "Telemetry: the run made its max_captures=%d captures; a %s naming rank %d and later "
                    "triggers are counted in train/capture/count, not captured (logged once)",
                    self._max,
                    order.trigger,
                    order.rank,
                )
            return
        self.ordered += 1
        self._queue.append(order)

    @property
    def idle(self) -> bool:
        """Nothing to send (read without the lock: what arrives meanwhile leaves with a later window)."""
        return not (self._counts or self._hangs or (self._queue and not self._roles))

    def take_counts(self) -> dict[str, int]:
        """The triggers counted since the last window, no longer to be carried by one."""
        with self._lock:
            counts, self._counts = self._counts, {}
            return counts

    def take(self) -> CaptureWindow:
        """What the next window carries from this rank: the counts since the last window, a hang
        capture, and an order if one waits and the last one settled."""
        with self._lock:
            order = None
            if not self._roles and self._queue:
                order = self._queue.popleft()
                self._roles = 1 if order.reference is None else 2
            counts, self._counts = self._counts, {}
            hang = self._hangs.popleft() if self._hangs else None
            return CaptureWindow(order, counts, hang)

    def settled(self, outcomes: CaptureOutcomes) -> None:
        """Every rank's outcomes of one window."""
        with self._lock:
            self._roles = max(0, self._roles - outcomes.settled)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"ordered": self.ordered}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            self.ordered = int(state.get("ordered", self.ordered))


class CaptureLedger:
    """What every rank's reports say of the captures, from what the windows carried alone: `began`
    and `carried` on the publishing thread, in window order; `hang_report` from the hang monitor."""

    def __init__(self, directory: Callable[[int, int, str], str]) -> None:
        self._directory = directory
        """The capture directory of (rank, step, reason), as its rank names it."""
        self._lock = threading.Lock()
        self._latest: tuple[int, int] | None = None
        self._files: dict[str, None] = {}
        self._began = ""

    def carried(self, window: CaptureWindow, began: Sequence[tuple[CaptureOrder, int]]) -> CaptureReport:
        """The report of a window that carried `window` (every rank's) and with which the orders of
        `began` began, each after its step."""
        with self._lock:
            if window.outcomes.missing:  # the rank named could not write it
                self._files.pop(self._began, None)
            if window.hang is not None:
                self._latest = window.hang
                self._files[self._directory(*window.hang, "hang")] = None
            for order, step in began:
                self._latest = (order.rank, step)
                self._began = self._directory(order.rank, step, order.reason)
                self._files[self._began] = None
            counts = {**window.counts, "failed": window.outcomes.failed}
            return CaptureReport(counts, self._latest, tuple(self._files))

    def hang_report(self, rank: int, step: int) -> CaptureReport:
        """What a hang report says, the rank it names having written its stacks to a capture at `step`
        (the next window carries it to every rank's ledger)."""
        with self._lock:
            files = (*self._files, self._directory(rank, step, "hang"))
            return CaptureReport({}, (rank, step), tuple(dict.fromkeys(files)))

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"latest": list(self._latest) if self._latest else None, "files": list(self._files)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            latest = state.get("latest")
            self._latest = (int(latest[0]), int(latest[1])) if latest else None
            self._files = dict.fromkeys(str(file) for file in state.get("files", ()))
