"""Step time per rank: host wall time between `Telemetry.step()` calls, and its extreme ranks.

`train/step_time` is one series per rank up to `max_rank_series` ranks (min/median/max above, by
`RankSeriesLimit`); `train/step_time/min_rank` and `max_rank` name the fastest and slowest rank as
values at any world size (the lowest rank on ties). In synchronous training every rank waits for
the slowest, so step times agree; stragglers show in the phases (`_phases`, `_stragglers`).

`train/step_time/histogram` counts the exporting rank's steps by their time (buckets
`STEP_TIME_BOUNDS`; in synchronous training they take as long as every rank's): one series per
exporting group, host-only (nothing rides the window's collective), the step-time series that
carries the exemplar linking to the slowest rank's trace (`_trace_sampling`).
"""

from __future__ import annotations

import bisect

from torchtelemetry.metric import Metric, MetricKind, PerRankMetric
from torchtelemetry.report._values import HistogramValue, MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import (
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)

__all__ = ["STEP_TIME", "STEP_TIME_BOUNDS", "STEP_TIME_HISTOGRAM", "StepTime"]

STEP_TIME = "train/step_time"
STEP_TIME_HISTOGRAM = "train/step_time/histogram"
STEP_TIME_BOUNDS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0),
)
"""Upper bounds (seconds) of the step-time histogram's buckets: 1 ms to 10 minutes."""


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
        self._buckets = [0] * (len(STEP_TIME_BOUNDS) + 1)
        self._bucketed_s = 0.0

    def metrics(self) -> dict[str, Metric]:
        return {STEP_TIME: self.metric}

    def descriptors(self) -> list[MetricDescriptor]:
        return [
            MetricDescriptor(STEP_TIME, MetricKind.GAUGE, "seconds", self.metric.description, "rank"),
            *(
                MetricDescriptor(f"{STEP_TIME}/{stat}_rank", description=f"Rank with the {stat} step time")
                for stat in ("min", "max")
            ),
            MetricDescriptor(
                STEP_TIME_HISTOGRAM,
                MetricKind.HISTOGRAM,
                "seconds",
                "Host wall time of each training step of the exporting rank",
            ),
        ]

    def on_step(self, step: int, step_time: float | None) -> None:
        if step_time is not None:
            self._total += step_time
            self._count += 1
            self._buckets[bisect.bisect_left(STEP_TIME_BOUNDS, step_time)] += 1
            self._bucketed_s += step_time

    def host_values(self) -> HistogramValue | None:
        """The window's steps by bucket (none: no step of the window had a previous one to time from)."""
        counts, self._buckets = self._buckets, [0] * len(self._buckets)
        seconds, self._bucketed_s = self._bucketed_s, 0.0
        steps = sum(counts)
        if not steps:
            return None
        return HistogramValue(STEP_TIME_BOUNDS, tuple(map(float, counts)), seconds, float(steps))

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self._count:
            self.metric.update_total(self._total, float(self._count))  # numbers in the kernels: no copy
        self._total, self._count = 0.0, 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        histogram = timing.host.get(self.name)
        if histogram is not None:
            window[STEP_TIME_HISTOGRAM] = histogram
        by_rank = finite_by_rank(window.get(STEP_TIME))
        if not by_rank:  # the first window of a run of one step: no step had a previous one to time from
            window.pop(STEP_TIME, None)
        else:
            window[f"{STEP_TIME}/min_rank"] = float(lowest_rank(by_rank))
            window[f"{STEP_TIME}/max_rank"] = float(highest_rank(by_rank))
