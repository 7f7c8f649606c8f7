"""Captures: the window's side of "a verdict brings its evidence" (docs/signals.md, Captures).

When a verdict names a rank, the exporting rank orders a capture there, and the order rides the next
window's collective in a few SUM slots only it fills (`CaptureSlots`): the rank named, the reference
rank, the trigger and a request's reason, with the triggers it counted and a hang capture it learned
of. Every rank reads the same order from the same reduced window, so every rank learns the same
decision at the same step; each rank adds what its own captures came to (settled, failed, failed on
the rank named) to the same slots. Every rank derives the same report from them. No collective of
its own, no message outside the process group.

The verdicts are read from the values the other signals derived (so this signal derives after the
phases and the non-finite sentinel): each rank `train/straggler/top_rank` names, with the median rank
of the phase it straggles in as reference, and the first rank that saw a non-finite value, in the
window that saw it first. What the run does with them (which become captures, the profile, the
files) is the run's (`torchtelemetry.run`'s `CaptureRun`), behind `CaptureSource`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchtelemetry.metric import DEFAULT_STATE_DTYPE, Metric, MetricAccumulator, MetricKind, ReduceOp
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming
from torchtelemetry.report.signals._nonfinite import FIRST_RANK, FIRST_STEP
from torchtelemetry.report.signals._phases import MEDIAN_RANK
from torchtelemetry.report.signals._stragglers import RANK, SCORE, TOP_RANK

__all__ = [
    "CAPTURE_DESCRIPTORS",
    "CAPTURE_REASONS",
    "CAPTURE_TRIGGERS",
    "CaptureOrder",
    "CaptureOutcomes",
    "CaptureReport",
    "CaptureSource",
    "CaptureWindow",
    "Captures",
    "IDLE",
    "Verdict",
    "check_capture_reason",
]

CAPTURE_TRIGGERS = ("straggler", "nonfinite", "hang")
"""The verdicts `TelemetryConfig.capture_on` may name (its default); "request" names only the user's."""
REQUEST = "request"
FAILED = "failed"
CAPTURE_REASONS = (*CAPTURE_TRIGGERS, REQUEST, FAILED)
"""The `reason` labels of `train/capture/count`: each trigger, the user's requests, failed captures."""
REASON_CHARS = 32
"""Characters a request's reason may have (one slot each)."""
_REASON = re.compile(rf"[a-z0-9_]{{1,{REASON_CHARS}}}")
_RESERVED = (*CAPTURE_TRIGGERS, FAILED, "reference")
"""Reasons a request may not give: they would read as another capture's directory."""
_ORDERED = ("straggler", "nonfinite", REQUEST)
"""The triggers an order may carry (a hang stops the windows: its rank captures on its own)."""
COUNTED = (*CAPTURE_TRIGGERS, REQUEST)
"""The triggers the exporting rank counts (failures are counted by every rank's outcomes)."""

STATE = "train/capture/window"
COUNT = "train/capture/count"
CAPTURE_RANK = "train/capture/rank"
CAPTURE_STEP = "train/capture/step"
CAPTURE_FILE = "train/capture/file"

CAPTURE_DESCRIPTORS = (
    MetricDescriptor(
        COUNT, MetricKind.COUNTER, "", "Verdicts that triggered a capture, and failed captures", "reason"
    ),
    MetricDescriptor(CAPTURE_RANK, MetricKind.GAUGE, "", "Rank of the latest capture"),
    MetricDescriptor(CAPTURE_STEP, MetricKind.GAUGE, "", "Step the latest capture began after"),
    MetricDescriptor(
        CAPTURE_FILE,
        MetricKind.GAUGE,
        "",
        "1 per capture, labelled with the directory of the rank it named",
        "file",
    ),
)
"""Every name the captures export (on the exporting rank)."""


def check_capture_reason(reason: str) -> str:
    """`reason` of `Telemetry.request_capture`, checked: it ends the capture directory's name."""
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise ValueError(
            f"Telemetry.request_capture: reason must be 1 to {REASON_CHARS} of a-z, 0-9 and _ (it ends "
            f"the capture directory's name), got {reason!r}"
        )
    if reason in _RESERVED:
        raise ValueError(
            f"Telemetry.request_capture: reason {reason!r} is one of the library's own "
            f"({', '.join(_RESERVED)}); name yours otherwise"
        )
    return reason


@dataclass(frozen=True, slots=True)
class Verdict:
    """A window's verdict naming a rank."""

    trigger: str
    """"straggler" or "nonfinite"."""
    rank: int
    reference: int | None = None
    """The healthy rank to capture beside it (a straggler's: the median rank of its phase)."""


@dataclass(frozen=True, slots=True)
class CaptureOrder:
    """A capture every rank learns from one window: on `rank`, and on `reference` as reference."""

    rank: int
    reference: int | None
    trigger: str
    """What triggered it: "straggler", "nonfinite" or "request" (the count's label)."""
    reason: str
    """The end of the directory's name: the trigger, or a request's own reason."""


@dataclass(frozen=True, slots=True)
class CaptureReport:
    """What a report says of the captures (every rank's the same)."""

    counts: Mapping[str, int]
    """Per `CAPTURE_REASONS` label, verdicts and failures since the last report (empty: not counted here)."""
    latest: tuple[int, int] | None
    """The latest capture's rank and step (None before the first)."""
    files: tuple[str, ...]
    """The directory of every capture on the rank it named, from when it began (unless it failed)."""

    def values(self) -> dict[str, ReportValue]:
        values: dict[str, ReportValue] = {}
        if self.counts:
            values[COUNT] = {reason: float(count) for reason, count in self.counts.items()}
        if self.latest is not None:  # once a capture began: its directory, until it failed
            values[CAPTURE_RANK], values[CAPTURE_STEP] = float(self.latest[0]), float(self.latest[1])
            values[CAPTURE_FILE] = dict.fromkeys(self.files, 1.0)
        return values


@dataclass(frozen=True, slots=True)
class CaptureOutcomes:
    """What one rank's captures came to since the last window (or, reduced, every rank's)."""

    settled: int = 0
    """Captures an order named this rank for (as named or reference) that ended, written or failed."""
    failed: int = 0
    """Captures that failed, hang captures included."""
    missing: int = 0
    """Captures that failed on the rank they named (their directory is not named any more)."""


@dataclass(frozen=True, slots=True)
class CaptureWindow:
    """What one window carries of the captures: one rank's part, or (reduced) every rank's."""

    order: CaptureOrder | None = None
    """The capture the exporting rank orders."""
    counts: Mapping[str, int] = field(default_factory=dict)
    """Triggers the exporting rank counted since the last window, by `COUNTED` label."""
    hang: tuple[int, int] | None = None
    """A hang capture the exporting rank learned of: the rank a hang names, and its step."""
    outcomes: CaptureOutcomes = CaptureOutcomes()


IDLE = CaptureWindow()
"""What a rank with nothing to carry stages (writes nothing: no op at all)."""


class CaptureSource(Protocol):
    """The run's captures (`torchtelemetry.run.CaptureRun`), as this signal drives them."""

    capturing: bool
    """A capture is under way on this rank: `stepped` wants every step."""

    def staged(self, final: bool) -> CaptureWindow:
        """Training thread, once per window: this rank's part of the next window."""
        ...

    def scheduled(self, step: int) -> Any:
        """Training thread: a window ending at `step` is being scheduled (orders carried far enough
        back begin here); what `collected` is to be given with it."""
        ...

    def stepped(self) -> None:
        """Training thread: a step of the capture under way ended."""
        ...

    def collected(self, scheduled: Any, carried: CaptureWindow, verdicts: Sequence[Verdict]) -> CaptureReport:
        """Publishing thread: the window `scheduled` returned for carried `carried` (every rank's, reduced)
        and named `verdicts`; what its report says of the captures (the same on every rank)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class CaptureSlots(Metric):
    """One window's `CaptureWindow`, summed over ranks: the order (rank + 1, reference + 1, the
    trigger's code, a request's reason as character codes), the counts and the hang (rank + 1,
    step + 1) are the exporting rank's alone (0 elsewhere); every rank adds its own outcomes."""

    _REASON = slice(3, 3 + REASON_CHARS)
    _OUTCOMES = slice(_REASON.stop, _REASON.stop + 3)
    _COUNTS = slice(_OUTCOMES.stop, _OUTCOMES.stop + len(COUNTED))
    _HANG = slice(_COUNTS.stop, _COUNTS.stop + 2)

    def __init__(self) -> None:
        super().__init__()
        self.slots = MetricAccumulator(torch.zeros(self._HANG.stop), ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE)

    def write(self, part: CaptureWindow) -> None:
        """Add this rank's `part` to its slots (staged host values, no op of its own)."""
        if part is IDLE:
            return
        outcomes = part.outcomes
        values = dict(enumerate((outcomes.settled, outcomes.failed, outcomes.missing), self._OUTCOMES.start))
        values |= dict(enumerate((part.counts.get(label, 0) for label in COUNTED), self._COUNTS.start))
        if part.hang is not None:
            values |= {self._HANG.start: part.hang[0] + 1, self._HANG.start + 1: part.hang[1] + 1}
        order = part.order
        if order is not None:
            reference = 0 if order.reference is None else order.reference + 1
            values |= {0: order.rank + 1, 1: reference, 2: _ORDERED.index(order.trigger) + 1}
            if order.reason != order.trigger:
                values |= dict(enumerate(map(ord, order.reason), self._REASON.start))
        for index, value in values.items():
            if value:
                self.slots.add_at(index, float(value))

    def compute(self) -> dict[str, torch.Tensor]:
        """The state itself, no copy: a window reads it into its report at once."""
        return {"slots": self.slots.value}

    @classmethod
    def read(cls, slots: Mapping[str, float]) -> CaptureWindow:
        """The `CaptureWindow` of a reduced window's slots (by index)."""
        if not any(slots.values()):  # between captures: nothing carried
            return CaptureWindow(None, dict.fromkeys(COUNTED, 0))
        value = [int(slots.get(str(index), 0.0)) for index in range(cls._HANG.stop)]
        counts = dict(zip(COUNTED, value[cls._COUNTS], strict=True))
        hang_rank, hang_step = value[cls._HANG]
        hang = (hang_rank - 1, hang_step - 1) if hang_rank else None
        order = None
        if value[0]:
            trigger = _ORDERED[value[2] - 1]
            reason = "".join(chr(code) for code in value[cls._REASON] if code) or trigger
            order = CaptureOrder(value[0] - 1, value[1] - 1 if value[1] else None, trigger, reason)
        return CaptureWindow(order, counts, hang, CaptureOutcomes(*value[cls._OUTCOMES]))


class Captures(Signal):
    """Carries capture orders and outcomes in the window and reads the verdicts (see the module)."""

    name = "captures"
    event_names = frozenset({CAPTURE_RANK, CAPTURE_STEP, CAPTURE_FILE})

    def __init__(self, context: SignalContext, source: CaptureSource) -> None:
        super().__init__(context)
        self.source = source
        self.state = CaptureSlots().to(context.device)
        self._step = 0

    def metrics(self) -> dict[str, Metric]:
        return {STATE: self.state}

    def descriptors(self) -> list[MetricDescriptor]:
        return list(CAPTURE_DESCRIPTORS)

    def on_step(self, step: int, step_time: float | None) -> None:
        self._step = step
        if self.source.capturing:  # the training thread's one check per step between captures
            self.source.stepped()

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        self.state.write(self.source.staged(final))

    def host_values(self) -> Any:
        return self.source.scheduled(self._step)

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        carried = CaptureSlots.read(_mapping(window.pop(f"{STATE}/slots", None)))
        verdicts = window_verdicts(window, timing.step)
        window.update(self.source.collected(timing.host.get(self.name), carried, verdicts).values())

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.source.load_state_dict(state)

    def close(self) -> None:
        self.source.close()


def window_verdicts(window: Mapping[str, ReportValue], step: int) -> list[Verdict]:
    """The verdicts of one window's derived values: each rank `top_rank` names (place 1 first), with
    the median rank of the phase it straggles in as reference, and the first rank that saw a
    non-finite value, in the window (ending at `step`) that saw it first."""
    verdicts = []
    top = _mapping(window.get(TOP_RANK))
    for place in sorted(top, key=int):
        rank = int(top[place])
        verdicts.append(Verdict("straggler", rank, _reference(window, rank)))
    first_steps = _mapping(window.get(FIRST_STEP))
    seen = {
        int(rank) for path, rank in _mapping(window.get(FIRST_RANK)).items() if first_steps.get(path) == step
    }
    verdicts += [Verdict("nonfinite", rank) for rank in sorted(seen)]
    return verdicts


def _reference(window: Mapping[str, ReportValue], rank: int) -> int | None:
    """The median rank of the phase where `rank` straggles most (where it is the slowest rank, else
    any phase scored), unless that is `rank` itself."""
    medians, scores = _mapping(window.get(MEDIAN_RANK)), _mapping(window.get(SCORE))
    named = [phase for phase, slowest in _mapping(window.get(RANK)).items() if int(slowest) == rank]
    phases = [phase for phase in (named or scores) if phase in medians]
    if not phases:
        return None
    reference = int(medians[max(phases, key=lambda phase: scores.get(phase, 0.0))])
    return None if reference == rank else reference


def _mapping(value: ReportValue | None) -> Mapping[str, float]:
    if value is None:  # before the ABC check, a Python call
        return {}
    return value if type(value) is dict or isinstance(value, Mapping) else {}
