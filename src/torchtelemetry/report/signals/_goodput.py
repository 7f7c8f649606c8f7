"""Goodput: the share of a run's wall time whose progress reached a checkpoint, across restarts.

The run keeps goodput's lasting state (`torchtelemetry.run`'s `GoodputLedger`: the first start, the
productive time, the restarts); this signal reads it once per window and exports it:

- `train/goodput`: productive time / wall time since the run's first start (a ratio);
- `train/goodput/productive_time`, `wall_time` (seconds);
- `train/goodput/restarts`: restarts from a checkpoint (a counter; one per launch that loaded one);
- `train/goodput/recomputed_steps`: steps trained past the checkpoint a restart went back to (a
  counter; known only with `TelemetryConfig.progress_file`, at window granularity).

Goodput and its times are left out until a checkpoint is known durable (`checkpoint_saved`, or a
restart from one): before that no time can have reached a checkpoint, and 0 % would read as a
failing run. The state rides the checkpoint as this signal's (`signals/goodput/...`).

Host-only: read on the training thread when the window is scheduled, no device state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["Goodput", "GoodputReading", "GoodputSource", "goodput_gauges"]

logger = logging.getLogger(__name__)

GOODPUT = "train/goodput"
PRODUCTIVE = "train/goodput/productive_time"
WALL = "train/goodput/wall_time"
RESTARTS = "train/goodput/restarts"
RECOMPUTED = "train/goodput/recomputed_steps"


@dataclass(frozen=True, slots=True)
class GoodputReading:
    """Goodput at one moment."""

    restarts: int
    """Restarts from a checkpoint in this launch (0 or 1)."""
    recomputed_steps: int
    """Steps this launch trains again after its restart."""
    productive_s: float | None = None
    """Time whose progress reached a checkpoint (None until one is known durable)."""
    wall_s: float | None = None
    """Time since the run's first start (None until a checkpoint is known durable)."""


def goodput_gauges(reading: GoodputReading) -> dict[str, float]:
    """The gauges of `reading` by name (none until a checkpoint is known durable)."""
    if reading.productive_s is None or reading.wall_s is None:
        return {}
    gauges = {PRODUCTIVE: reading.productive_s, WALL: reading.wall_s}
    if reading.wall_s > 0:
        gauges[GOODPUT] = min(reading.productive_s / reading.wall_s, 1.0)
    return gauges


class GoodputSource(Protocol):
    """The run's goodput state, as the signal reads and checkpoints it."""

    def reading(self) -> GoodputReading:
        """Goodput now."""
        ...

    def state_dict(self, step: int | None) -> dict[str, Any]:
        """The state a checkpoint of `step` carries."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a checkpoint's state."""
        ...


class Goodput(Signal):
    """Exports the run's goodput (see the module) from `source`; with None it only describes the names."""

    name = "goodput"

    def __init__(self, context: SignalContext, source: GoodputSource | None = None) -> None:
        super().__init__(context)
        self._source = source
        self._step: int | None = None
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

    def host_values(self) -> dict[str, float] | None:
        if self._source is None:
            return None
        reading = self._source.reading()
        counted = self._counted  # counters: only what was not counted yet, never less
        values = {
            RESTARTS: float(max(reading.restarts - counted[0], 0)),
            RECOMPUTED: float(max(reading.recomputed_steps - counted[1], 0)),
        }
        self._counted = (max(reading.restarts, counted[0]), max(reading.recomputed_steps, counted[1]))
        gauges = goodput_gauges(reading)
        if not gauges and not self._said_unknown:
            self._said_unknown = True
            logger.info(
                "Telemetry: train/goodput is not exported until a checkpoint is marked durable "
                "(Telemetry.checkpoint_saved) or the run restarts from one"
            )
        return values | gauges

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        window.update(timing.host.get(self.name, {}))

    def state_dict(self) -> dict[str, Any]:
        return self._source.state_dict(self._step) if self._source is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._source is None or "first_start" not in state:
            return
        self._source.load_state_dict(state)  # checks the state first
        saved_step = int(state.get("step", -1))
        self._step = saved_step if saved_step >= 0 else None
