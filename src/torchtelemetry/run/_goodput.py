"""Goodput's lasting state: the run's first start and the time whose progress reached a checkpoint,
across its attempts (the signal that exports it per window is `report.signals`' `Goodput`).

`checkpoint_saved(step)` says the checkpoint of `step` is durable: the time up to the moment its
state was taken (`state_dict()` at that step; else now) is productive. The state carries the run's
first start and its productive time (up to the moment it was taken: if the run ever restarts from
it, everything before reached it). After a restart from a checkpoint, the time since that state was
taken (the work redone, the downtime, the restart itself) is lost, and the steps the progress file
holds past the checkpoint were trained again.

Times are read from the clock of every exported timestamp (`wall_time`: monotonic since import), so
a system clock set forward or back changes neither. Host-only, on the training thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torchtelemetry.report import GoodputReading, goodput_gauges, wall_time
from torchtelemetry.run._progress import RunProgress

__all__ = ["GoodputLedger"]


class GoodputLedger:
    """Goodput of one run (see the module); `progress` (the run's progress file, if it keeps one)
    gives the steps trained again after a restart."""

    def __init__(self, progress: RunProgress | None) -> None:
        self._progress = progress
        self.first_start = self._durable_at = wall_time()
        self._productive_s = 0.0
        self._known = False
        self._taken: dict[int, float] = {}
        self._resumed: tuple[int, int] | None = None
        self._read_at: float | None = None
        """`_durable_at` as the last reading saw it (None before the first reading)."""

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of `step` is durable: progress up to when its state was taken counts."""
        taken = self._taken.pop(step, None) or wall_time()
        self._taken = {saved: at for saved, at in self._taken.items() if saved > step}
        self._known = True
        if taken > self._durable_at:
            self._productive_s += taken - self._durable_at
            self._durable_at = taken

    def reading(self) -> GoodputReading:
        """Goodput now: the restarts and recomputed steps of this launch, and the productive and wall
        times once a checkpoint is known durable."""
        self._read_at = self._durable_at
        restarts, recomputed = self._resumed if self._resumed is not None else (0, 0)
        if not self._known:
            return GoodputReading(restarts, recomputed)
        return GoodputReading(
            restarts, recomputed, self._productive_s, max(wall_time() - self.first_start, 0.0)
        )

    def late_gauges(self) -> dict[str, float]:
        """Goodput's gauges now, if a checkpoint was marked durable after the last `reading()` (the
        last window was scheduled before it: `close()` exports them after that window); else none."""
        if self._read_at is None or self._read_at == self._durable_at:
            return {}
        return goodput_gauges(self.reading())

    def state_dict(self, step: int | None) -> dict[str, Any]:
        """The state a checkpoint of `step` (the last step trained; None before the first) carries."""
        now = wall_time()
        if step is not None:
            self._taken[step] = now
        return {
            "first_start": self.first_start,
            "productive_s": self._productive_s + max(now - self._durable_at, 0.0),
            "step": -1 if step is None else step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a checkpoint's state: one restart per launch, however often this is called
        (a resume helper, then a framework); the last call's state wins."""
        if "first_start" not in state:
            return
        first_start, productive_s, saved_step = _checked_state(state)
        reached = self._progress.reached_step() if self._progress is not None else None
        self.first_start = first_start
        self._productive_s = productive_s
        self._durable_at = wall_time()
        self._known = True
        self._resumed = (1, reached - saved_step if reached is not None and reached > saved_step else 0)


def _checked_state(state: Mapping[str, Any]) -> tuple[float, float, int]:
    """The first start, productive seconds and step of a goodput state; raises a ValueError naming
    the entry before anything is restored."""
    first_start, productive_s = state.get("first_start"), state.get("productive_s")
    step = state.get("step", -1)
    for key, value in (("first_start", first_start), ("productive_s", productive_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(
                f"Telemetry.load_state_dict: signals/goodput/{key} must be a finite number, got {value!r}"
            )
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"Telemetry.load_state_dict: signals/goodput/step must be an integer, got {step!r}")
    return float(first_start), max(float(productive_s), 0.0), step
