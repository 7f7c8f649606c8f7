"""One rank's captures for one `Telemetry`: orders in, sessions run, outcomes out (docs/signals.md,
Captures). The window carries the rest (`torchtelemetry.report`'s `Captures` signal drives this).

Every rank reads each order from the window that carried it (window `n`, the same reduced values on
every rank) and begins it when window `n + max_pending` is scheduled: the first point at which every
rank has surely collected window `n` (the collector's ring holds `max_pending` windows, so scheduling
that one waits for window `n` if it were still in flight), so the rank named and its reference begin
after the same step, with no wait and no message of their own. Between captures the training thread
checks one flag per step (`capturing`). The exporting rank also decides (`CaptureDesk`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtelemetry.config import TelemetryConfig
from torchtelemetry.report import (
    IDLE,
    CaptureOrder,
    CaptureOutcomes,
    CaptureReport,
    CaptureWindow,
    ReportValues,
    Verdict,
    check_capture_reason,
)
from torchtelemetry.run._capture_desk import CaptureDesk, CaptureLedger
from torchtelemetry.run._capture_session import CaptureSession, CaptureSpec, warm_profiler
from torchtelemetry.run._dumps import HangCaptures, capture_name, dump_directory
from torchtelemetry.run._hangs import HANG_DUMP, HANG_RANK, HANG_STEP

__all__ = ["CaptureRun", "CaptureSettings"]

logger = logging.getLogger(__name__)

WRITE_WAIT_S = 30.0
"""How long a checkpoint or close waits for a capture's files still being written."""
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events `TelemetryConfig.memory_history` keeps (the newest; `_record_memory_history`)."""


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """What captures take from `TelemetryConfig` (each field's docs there)."""

    triggers: tuple[str, ...]
    steps: int
    max_captures: int
    dump_dir: Path
    memory_history: bool

    @classmethod
    def of(cls, config: TelemetryConfig) -> CaptureSettings | None:
        """The settings of `config`; None when captures are off (`capture_on` empty, or no signals)."""
        if not config.capture_on or not config.signals:
            return None
        return cls(
            tuple(config.capture_on),
            config.capture_steps,
            config.max_captures,
            dump_directory(config.dump_dir),
            config.memory_history,
        )


class CaptureRun:
    """This rank's captures (see the module); the `CaptureSource` of the `Captures` signal."""

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        rank: int,
        world_size: int,
        exporting: bool,
        max_pending: int,
        device: torch.device,
        run_id: str,
        flight_recorder: bool,
    ) -> None:
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        """The run the directories are named after (the id the ranks agreed on: `adopt_run`)."""
        self.capturing = False
        """A capture is under way on this rank (the training thread checks it every step)."""
        self._desk = CaptureDesk(settings.triggers, settings.max_captures) if exporting else None
        self._ledger = CaptureLedger(self._directory)
        self.hang = HangCaptures(settings.max_captures if "hang" in settings.triggers else 0)
        """Where a stuck rank's stacks go (its hang captures)."""
        self._max_pending = max_pending
        self._cuda = device.type == "cuda"
        self._flight_recorder = flight_recorder
        self._lock = threading.Lock()
        self._inbox: dict[int, CaptureOrder] = {}
        self._windows = 0
        self._final = False
        self._session: CaptureSession | None = None
        self._named = False
        """The capture under way is of this rank (not as a reference)."""
        self._written: list[tuple[CaptureSession, bool]] = []
        self._hang_failed = 0
        self._warming: threading.Thread | None = None
        self._memory = self._cuda and settings.memory_history and _record_memory_history(True)

    def _directory(self, rank: int, step: int, reason: str) -> str:
        return str(self.settings.dump_dir / capture_name(self.run_id, rank, step, reason))

    # -- the training thread -------------------------------------------------------------------

    def staged(self, final: bool) -> CaptureWindow:
        """This rank's part of the next window: its outcomes since the last call (and the exporting
        rank's order, counts and hang capture); a `final` flush (a checkpoint, close) waits, bounded,
        for files still being written."""
        self._final = final
        desk = self._desk
        if not self._written and self.hang.failed == self._hang_failed and (desk is None or desk.idle):
            return IDLE  # between captures
        if final:
            for session, _ in self._written:
                session.wait(WRITE_WAIT_S)
        settled, self._written = _partition(self._written)
        failed = self.hang.failed - self._hang_failed
        self._hang_failed += failed
        outcomes = CaptureOutcomes(
            len(settled),
            failed + sum(not session.ok for session, _ in settled),
            sum(named and not session.ok for session, named in settled),
        )
        part = self._desk.take() if self._desk is not None else CaptureWindow()
        return CaptureWindow(part.order, part.counts, part.hang, outcomes)

    def scheduled(self, step: int) -> tuple[int, tuple[tuple[CaptureOrder, int], ...]]:
        """The window scheduled after `step`: its index, and the orders carried by windows up to
        `index - max_pending`, which begin here (not at the last window: no step follows it)."""
        index, self._windows = self._windows, self._windows + 1
        if self._final or not self._inbox:
            return index, ()
        with self._lock:
            due = sorted(n for n in self._inbox if n <= index - self._max_pending)
            orders = [self._inbox.pop(n) for n in due]
        for order in orders:
            self._begin(order, step)
        return index, tuple((order, step) for order in orders)

    def _begin(self, order: CaptureOrder, step: int) -> None:
        if self.rank not in (order.rank, order.reference):
            return
        named = self.rank == order.rank
        name = capture_name(self.run_id, self.rank, step, order.reason, reference=not named)
        role = "the rank named by" if named else f"the reference rank of rank {order.rank}'s"
        spec = CaptureSpec(
            self.settings.dump_dir / name,
            f"torchtelemetry: run {self.run_id}: rank {self.rank} is {role} capture ({order.trigger}: "
            f"{order.reason}) after step {step}; Python stacks of every thread when it began (most recent "
            "call first):",
            self.settings.steps,
            self._cuda,
            self._memory,
            self._flight_recorder,
        )
        if self._session is not None:  # one order at a time (`CaptureDesk`): after a restart, say
            self._end()
        session = CaptureSession(spec)
        if session.start():
            self._session, self._named, self.capturing = session, named, True
        else:
            self._written.append((session, named))

    def stepped(self) -> None:
        """A step of the capture under way ended: finish it once it holds its steps."""
        session = self._session
        if session is not None and session.stepped():
            self._end()

    def _end(self) -> None:
        session = self._session
        assert session is not None
        session.finish()
        self._written.append((session, self._named))
        self._session, self.capturing = None, False

    def request(self, rank: int, reason: str) -> None:
        """`Telemetry.request_capture`: on the exporting rank only, any thread."""
        if self._desk is None:
            raise RuntimeError(
                f"Telemetry.request_capture: rank {self.rank} does not export; call it on the exporting "
                "rank (where telemetry.is_exporting), whose request rides the next window to every rank"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"Telemetry.request_capture: rank must be a rank of the group (0 to {self.world_size - 1}), "
                f"got {rank!r}"
            )
        self._desk.request(rank, check_capture_reason(reason))

    # -- the publishing thread and the hang monitor ------------------------------------------------

    def collected(
        self,
        scheduled: tuple[int, Sequence[tuple[CaptureOrder, int]]] | None,
        carried: CaptureWindow,
        verdicts: Sequence[Verdict],
    ) -> CaptureReport:
        """The window `scheduled` returned (its index, the orders begun with it) carried `carried`
        (every rank's): its order begins `max_pending` windows later; the exporting rank settles,
        judges `verdicts` and counts; every rank reports the same."""
        index, began = scheduled if scheduled is not None else (0, ())
        order = carried.order
        if order is not None:
            with self._lock:
                self._inbox[index] = order
            if self.rank in (order.rank, order.reference) and self._warming is None:
                self._warming = threading.Thread(
                    target=warm_profiler, name="torchtelemetry-capture-warmup", daemon=True
                )
                self._warming.start()
        if self._desk is not None:
            self._desk.settled(carried.outcomes)
            self._desk.judge(verdicts)
        return self._ledger.carried(carried, began)

    def late_counts(self) -> ReportValues:
        """The triggers the exporting rank counted after the last window (that window's own verdicts,
        a hang capture learned since): no window carries them, so `close()` exports them with the
        last report."""
        if self._desk is None:
            return {}
        return CaptureReport(self._desk.take_counts(), None, ()).values()

    def hang_reported(self, values: ReportValues) -> ReportValues:
        """A hang report (the exporting rank's monitor's), with the captures' values once the rank it
        names wrote its stacks to a hang capture; the next window counts it."""
        dumps, rank, step = values.get(HANG_DUMP), values.get(HANG_RANK), values.get(HANG_STEP)
        if self._desk is None or not isinstance(dumps, Mapping):
            return values
        if not (isinstance(rank, float) and isinstance(step, float) and math.isfinite(rank + step)):
            return values
        captured = self._directory(int(rank), int(step), "hang")
        if not any(Path(dump).parent == Path(captured) for dump in dumps):
            return values
        self._desk.hang_captured(int(rank), int(step))
        return {**values, **self._ledger.hang_report(int(rank), int(step)).values()}

    # -- the run ------------------------------------------------------------------------------------

    def adopt_run(self, run_id: str) -> None:
        self.run_id = run_id

    def state_dict(self) -> dict[str, Any]:
        desk = self._desk.state_dict() if self._desk is not None else {}
        return {**desk, **self._ledger.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._desk is not None:
            self._desk.load_state_dict(state)
        self._ledger.load_state_dict(state)

    def close(self) -> None:
        """End a capture under way (its files are written) and wait, bounded, for every file; stop the
        allocator's history recording this started."""
        if self._session is not None:
            self._end()
        if self._warming is not None:
            self._warming.join(WRITE_WAIT_S)
        for session, _ in self._written:
            if not session.wait(WRITE_WAIT_S):
                logger.warning(
                    "Telemetry: capture %s is still being written at close", session.spec.directory
                )
        if self._memory:
            _record_memory_history(False)


def _partition(
    written: list[tuple[CaptureSession, bool]],
) -> tuple[list[tuple[CaptureSession, bool]], list[tuple[CaptureSession, bool]]]:
    """(The captures whose files are written or failed, those still being written), each read once."""
    ended: list[tuple[CaptureSession, bool]] = []
    writing: list[tuple[CaptureSession, bool]] = []
    for entry in written:
        (ended if entry[0].done.is_set() else writing).append(entry)
    return ended, writing


def _record_memory_history(on: bool) -> bool:
    """Start (or stop) the CUDA allocator's history recording; False (logged) when it cannot."""
    try:
        if on:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        else:
            torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as error:  # private API, untestable without CUDA: guarded and logged
        what = "started" if on else "stopped"
        logger.warning("Telemetry: the CUDA allocator's memory history could not be %s: %s", what, error)
        return False
    return True
