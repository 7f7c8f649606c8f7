"""The data wait: host time each step spent waiting for its batch, per rank (the phase "data").

Fed by `with telemetry.data_wait():` (a `HostTimer`) or `step(data_time=seconds)`, added up within
a step. `train/data_wait` is seconds per step and `train/data_wait_share` the waits over the
window's wall time (torchtitan's `data_loading(%)`), both per rank (`RankSeriesLimit` above
`max_rank_series` ranks). Not exported until fed on the exporting rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric import Metric, MetricKind, PerRankMetric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming
from torchtelemetry.report.signals._clock import HostTimer, TracedHostTimer
from torchtelemetry.report.signals._timeline import NO_SECTIONS, SectionLog

__all__ = ["DATA_PHASE", "DATA_WAIT", "DATA_WAIT_SHARE", "DataWait", "check_seconds"]

DATA_PHASE = "data"
"""The data wait's phase name (`Telemetry.phase("data")` is `data_wait()`)."""
DATA_WAIT = "train/data_wait"
DATA_WAIT_SHARE = "train/data_wait_share"


class DataWait(Signal):
    """Seconds per step waiting for data, and their share of the wall time, per rank."""

    name = "data_wait"
    keywords = ("data_time",)

    def __init__(self, context: SignalContext, log: SectionLog = NO_SECTIONS) -> None:
        """`log`: the window's timeline for its trace, where each timed wait goes as the section "data"."""
        super().__init__(context)

        def per_rank(unit: str, description: str) -> PerRankMetric:
            return PerRankMetric(context.world_size, context.rank, unit=unit, description=description).to(
                context.device
            )

        self.wait = per_rank("seconds", "Mean time per step spent waiting for the next batch, per rank")
        self.share = per_rank("percent", "Share of the window's wall time spent waiting for data, per rank")
        self._seconds = 0.0
        self._steps = 0
        self._seen = False
        self._timer = (
            TracedHostTimer(self.record_wait, DATA_PHASE, log=log, kind=log.kind(DATA_PHASE))
            if log.keeps
            else HostTimer(self.record_wait, DATA_PHASE)
        )

    def timers(self) -> dict[str, HostTimer]:
        """The data wait's timer, as the phase "data" (`Telemetry.data_wait()`)."""
        return {DATA_PHASE: self._timer}

    def metrics(self) -> dict[str, Metric]:
        return {DATA_WAIT: self.wait, DATA_WAIT_SHARE: self.share}

    def descriptors(self) -> list[MetricDescriptor]:
        return [
            MetricDescriptor(DATA_WAIT, MetricKind.GAUGE, "seconds", self.wait.description, "rank"),
            MetricDescriptor(DATA_WAIT_SHARE, MetricKind.GAUGE, "percent", self.share.description, "rank"),
        ]

    def check(self, keyword: str, value: Any) -> None:
        check_seconds(value)

    def sample_inputs(self) -> dict[str, Any]:
        return {"data_time": 0.001}

    def record(self, keyword: str, value: Any) -> None:
        self.record_wait(float(value))

    def record_wait(self, seconds: float) -> None:
        """Add `seconds` (checked, or measured by a `HostTimer`) to the current step's wait."""
        self._seen = True
        self._seconds += seconds

    def on_step(self, step: int, step_time: float | None) -> None:
        self._steps += 1

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        """The share is the waits over the durations, so a flush in mid-window changes nothing."""
        self.wait.update_total(self._seconds, float(self._steps))
        self.share.update_total(100 * self._seconds, duration_s)
        self._seconds, self._steps = 0.0, 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        if not self._seen:
            window.pop(DATA_WAIT, None)
            window.pop(DATA_WAIT_SHARE, None)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self._seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._seen = bool(state.get("seen", self._seen))


def check_seconds(seconds: Any) -> None:
    """Raise, naming `train/data_wait`, unless `seconds` is a finite number of host seconds >= 0."""
    if isinstance(seconds, torch.Tensor) or not isinstance(seconds, int | float):
        kind = type(seconds).__name__
        raise TypeError(f"{DATA_WAIT}: data wait must be host seconds (a float), got {kind}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{DATA_WAIT}: data wait must be a finite number of seconds >= 0, got {seconds}")
