"""Goodput: the share of a run's wall time whose progress reached a checkpoint, across restarts.

`Telemetry.checkpoint_saved(step)` says the checkpoint of `step` is durable: the time up to the
moment its state was taken (`Telemetry.state_dict()` at that step; else now) is productive. The
state carries the run's first start and its productive time (up to the moment it was taken: if
the run ever restarts from it, everything before reached it). After a restart from a checkpoint,
the time since that state was taken (the work redone, the downtime, the restart itself) is lost.

- `train/goodput`: productive time / wall time since the run's first start (a ratio);
- `train/goodput/productive_time`, `wall_time` (seconds);
- `train/goodput/restarts`: restarts from a checkpoint (a counter; `load_state_dict` counts one
  per launch, however often it is called);
- `train/goodput/recomputed_steps`: steps trained past the checkpoint a restart went back to (a
  counter). Known only with `TelemetryConfig.progress_file` (`ProgressFile`), which the exporting
  rank of each group rewrites each window with the run id and its last step (off every other
  thread); steps are counted at window granularity, up to the last window written before the failure.

Goodput and its times are left out until a checkpoint is known durable (`checkpoint_saved`, or a
restart from one): before that no time can have reached a checkpoint, and 0 % would read as a
failing run. Times are read from the clock of every exported timestamp (`wall_time`: monotonic
since import), so a system clock set forward or back changes neither.

Host-only: read on the training thread when the window is scheduled, no device state.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._clock import wall_time
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming
from torchtelemetry.report.signals._progress import ProgressFile

__all__ = ["Goodput"]

logger = logging.getLogger(__name__)

GOODPUT = "train/goodput"
PRODUCTIVE = "train/goodput/productive_time"
WALL = "train/goodput/wall_time"
RESTARTS = "train/goodput/restarts"
RECOMPUTED = "train/goodput/recomputed_steps"


class Goodput(Signal):
    """Goodput of one run (see the module); `progress_file` (this group's file, written by the
    group's rank 0 only) enables recomputed steps."""

    name = "goodput"

    def __init__(
        self, context: SignalContext, *, run_id: str, progress_file: str | os.PathLike[str] | None
    ) -> None:
        super().__init__(context)
        self.run_id = run_id
        """The run id the progress file is written under (the exported one; `Telemetry` sets it
        when the run's id is agreed or adopted from a checkpoint)."""
        self.progress = ProgressFile(progress_file) if progress_file is not None else None
        self._writes = context.rank == 0
        self.first_start = self._durable_at = wall_time()
        self._productive_s = 0.0
        self._known = False
        self._step: int | None = None
        self._taken: dict[int, float] = {}
        self._resumed: tuple[int, int] | None = None
        self._counted = (0, 0)
        self._said_unknown = False

    def descriptors(self) -> list[MetricDescriptor]:
        return [
            MetricDescriptor(
                GOODPUT,
                MetricKind.GAUGE,
                "ratio",
                "Wall time since the run's first start whose progress reached a checkpoint",
            ),
            MetricDescriptor(
                PRODUCTIVE, MetricKind.GAUGE, "seconds", "Wall time whose progress reached a checkpoint"
            ),
            MetricDescriptor(WALL, MetricKind.GAUGE, "seconds", "Wall time since the run's first start"),
            MetricDescriptor(RESTARTS, MetricKind.COUNTER, "", "Restarts from a checkpoint"),
            MetricDescriptor(RECOMPUTED, MetricKind.COUNTER, "", "Steps trained again after restarts"),
        ]

    def on_step(self, step: int, step_time: float | None) -> None:
        self._step = step

    def adopt_run(self, run_id: str) -> None:
        self.run_id = run_id

    def run_progress(self) -> ProgressFile | None:
        return self.progress

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of `step` is durable: progress up to when its state was taken counts."""
        taken = self._taken.pop(step, None) or wall_time()
        self._taken = {saved: at for saved, at in self._taken.items() if saved > step}
        self._known = True
        if taken > self._durable_at:
            self._productive_s += taken - self._durable_at
            self._durable_at = taken

    def host_values(self) -> dict[str, float]:
        restarts, recomputed = (1, self._resumed[1]) if self._resumed is not None else (0, 0)
        counted = self._counted  # counters: only what was not counted yet, never less
        values = {
            "restarts": float(max(restarts - counted[0], 0)),
            "recomputed": float(max(recomputed - counted[1], 0)),
        }
        self._counted = (max(restarts, counted[0]), max(recomputed, counted[1]))
        if self._known:
            values["productive_s"] = self._productive_s
            values["wall_s"] = max(wall_time() - self.first_start, 0.0)
        elif not self._said_unknown:
            self._said_unknown = True
            logger.info(
                "Telemetry: train/goodput is not exported until a checkpoint is marked durable "
                "(Telemetry.checkpoint_saved) or the run restarts from one"
            )
        return values

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        values = timing.host.get(self.name)
        if not values:
            return
        window[RESTARTS] = values["restarts"]
        window[RECOMPUTED] = values["recomputed"]
        if "wall_s" in values:
            wall_s = values["wall_s"]
            window[PRODUCTIVE] = values["productive_s"]
            window[WALL] = wall_s
            if wall_s > 0:
                window[GOODPUT] = min(values["productive_s"] / wall_s, 1.0)
        if self.progress is not None and self._writes:
            self.progress.write(self.run_id, timing.step)

    def state_dict(self) -> dict[str, Any]:
        now = wall_time()
        if self._step is not None:
            self._taken[self._step] = now
        return {
            "first_start": self.first_start,
            "productive_s": self._productive_s + max(now - self._durable_at, 0.0),
            "step": -1 if self._step is None else self._step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a checkpoint's state: one restart per launch, however often this is called
        (a resume helper, then a framework); the last call's state wins."""
        if "first_start" not in state:
            return
        first_start, productive_s, saved_step = _checked_state(state)
        reached = self._reached_step()
        self.first_start = first_start
        self._productive_s = productive_s
        self._durable_at = wall_time()
        self._known = True
        recomputed = reached - saved_step if reached is not None and reached > saved_step else 0
        self._resumed = (1, recomputed)
        self._step = saved_step if saved_step >= 0 else None

    def _reached_step(self) -> int | None:
        """The last step the progress file holds for this run, if it does."""
        progress = self.progress
        record = progress.read() if progress is not None else None
        if progress is None or record is None:
            return None
        run_id, step = record
        if run_id != self.run_id:
            logger.warning(
                "Telemetry: progress_file %s belongs to run %r, not %r; recomputed steps not counted",
                progress.path,
                run_id,
                self.run_id,
            )
            return None
        return step

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


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
