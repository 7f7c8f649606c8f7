"""Goodput: the share of a run's wall time whose progress reached a checkpoint, across restarts.

`Telemetry.checkpoint_saved(step)` says the checkpoint of `step` is durable: the time up to the
moment its state was taken (`Telemetry.state_dict()` at that step; else now) is productive. The
state carries the run's first start and its productive time (up to the moment it was taken: if
the run ever restarts from it, everything before reached it). After a restart from a checkpoint,
the time since that state was taken (the work redone, the downtime, the restart itself) is lost.

- `train/goodput`: productive time / wall time since the run's first start (a ratio);
- `train/goodput/productive_time`, `wall_time` (seconds);
- `train/goodput/restarts`: restarts from a checkpoint (a counter);
- `train/goodput/recomputed_steps`: steps trained past the checkpoint a restart went back to (a
  counter). Known only with `TelemetryConfig.progress_file`, which the exporting rank rewrites each
  window with the run id and its last step (off the training thread); steps are counted at window
  granularity, up to the last window collected before the failure.

Host-only: read from the exporting rank's clock when the window is scheduled, no device state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["Goodput"]

logger = logging.getLogger(__name__)

GOODPUT = "train/goodput"
PRODUCTIVE = "train/goodput/productive_time"
WALL = "train/goodput/wall_time"
RESTARTS = "train/goodput/restarts"
RECOMPUTED = "train/goodput/recomputed_steps"


class Goodput(Signal):
    """Goodput of one run (see the module); `progress_file` enables recomputed steps."""

    name = "goodput"

    def __init__(
        self, context: SignalContext, *, run_id: str, progress_file: str | os.PathLike[str] | None
    ) -> None:
        super().__init__(context)
        self.run_id = run_id
        self.progress_file = Path(progress_file) if progress_file is not None else None
        self.first_start = self._durable_at = time.time()
        self._productive_s = 0.0
        self._step: int | None = None
        self._taken: dict[int, float] = {}
        self._restarts = 0
        self._recomputed = 0
        self._write_failed = False

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

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of `step` is durable: progress up to when its state was taken counts."""
        taken = self._taken.pop(step, None) or time.time()
        self._taken = {saved: at for saved, at in self._taken.items() if saved > step}
        if taken > self._durable_at:
            self._productive_s += taken - self._durable_at
            self._durable_at = taken

    def host_values(self) -> dict[str, float]:
        now = time.time()
        values = {
            "productive_s": self._productive_s,
            "wall_s": max(now - self.first_start, 0.0),
            "restarts": float(self._restarts),
            "recomputed": float(self._recomputed),
        }
        self._restarts = self._recomputed = 0
        return values

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        values = timing.host.get(self.name)
        if not values:
            return
        wall_s = values["wall_s"]
        window[PRODUCTIVE] = values["productive_s"]
        window[WALL] = wall_s
        if wall_s > 0:
            window[GOODPUT] = min(values["productive_s"] / wall_s, 1.0)
        window[RESTARTS] = values["restarts"]
        window[RECOMPUTED] = values["recomputed"]
        self._write_progress(timing.step)

    def _write_progress(self, step: int) -> None:
        if self.progress_file is None:
            return
        partial = self.progress_file.with_name(self.progress_file.name + ".partial")
        try:
            partial.write_text(json.dumps({"run_id": self.run_id, "step": step, "time": time.time()}))
            os.replace(partial, self.progress_file)
        except OSError as error:
            if not self._write_failed:
                self._write_failed = True
                logger.warning("Telemetry: cannot write progress_file %s: %s", self.progress_file, error)

    def state_dict(self) -> dict[str, Any]:
        now = time.time()
        if self._step is not None:
            self._taken[self._step] = now
        return {
            "first_start": self.first_start,
            "productive_s": self._productive_s + max(now - self._durable_at, 0.0),
            "step": -1 if self._step is None else self._step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "first_start" not in state:
            return
        self.first_start = float(state["first_start"])
        self._productive_s = float(state["productive_s"])
        self._durable_at = time.time()
        self._restarts += 1
        reached = self._reached_step()
        saved_step = int(state.get("step", -1))
        if reached is not None and reached > saved_step:
            self._recomputed += reached - saved_step
        self._step = saved_step if saved_step >= 0 else None

    def _reached_step(self) -> int | None:
        """The last step the progress file holds for this run, if it does."""
        if self.progress_file is None:
            return None
        try:
            progress = json.loads(self.progress_file.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            logger.warning(
                "Telemetry: progress_file %s unreadable (%s); recomputed steps not counted",
                self.progress_file,
                error,
            )
            return None
        if progress.get("run_id") != self.run_id:
            return None
        return int(progress["step"])
