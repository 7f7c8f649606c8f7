"""Step time per rank: host wall time between `Telemetry.step()` calls, and its extreme ranks.

`train/step_time` is one series per rank up to `max_rank_series` ranks (min/median/max above, by
`RankSeriesLimit`); `train/step_time/min_rank` and `max_rank` name the fastest and slowest rank as
values at any world size (the lowest rank on ties). In synchronous training every rank waits for
the slowest, so step times agree; stragglers show in the phases (`_phases`, `_stragglers`).
"""

from __future__ import annotations

from torchtelemetry.metric import Metric, MetricKind, PerRankMetric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import (
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)

__all__ = ["STEP_TIME", "StepTime"]

STEP_TIME = "train/step_time"


class StepTime(Signal):
    """Mean host time of a step, per rank (the first step has no previous one to time from)."""

    name = "step_time"

    def __init__(self, context: SignalContext) -> None:
        super().__init__(context)
        self.metric = PerRankMetric(
            context.world_size,
            context.rank,
            unit="seconds",
            description="Mean host wall time of a training step, per rank",
        ).to(context.device)
        self._total = 0.0
        self._count = 0

    def metrics(self) -> dict[str, Metric]:
        return {STEP_TIME: self.metric}

    def descriptors(self) -> list[MetricDescriptor]:
        return [
            MetricDescriptor(STEP_TIME, MetricKind.GAUGE, "seconds", self.metric.description, "rank"),
            *(
                MetricDescriptor(f"{STEP_TIME}/{stat}_rank", description=f"Rank with the {stat} step time")
                for stat in ("min", "max")
            ),
        ]

    def on_step(self, step: int, step_time: float | None) -> None:
        if step_time is not None:
            self._total += step_time
            self._count += 1

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self._count:
            self.metric.update_total(self._total, float(self._count))  # numbers in the kernels: no copy
        self._total, self._count = 0.0, 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        by_rank = finite_by_rank(window.get(STEP_TIME))
        if not by_rank:  # the first window of a run of one step: no step had a previous one to time from
            window.pop(STEP_TIME, None)
        else:
            window[f"{STEP_TIME}/min_rank"] = float(lowest_rank(by_rank))
            window[f"{STEP_TIME}/max_rank"] = float(highest_rank(by_rank))
