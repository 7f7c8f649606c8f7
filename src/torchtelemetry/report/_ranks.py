"""Values per rank within the cardinality budget: the series a run exports grow with its metrics,
not with its ranks.

A value per rank is a mapping labelled `rank` (a `PerRankMetric`, the built-in step time and data
wait). Up to `max_rank_series` ranks it is exported as one series per rank. Above, a gauge becomes
three series whatever the world size, min, median and max over ranks, and a counter its total over
ranks. Ranks that matter travel as values, never as labels (the built-in step time's
`min_rank` / `max_rank`, exported at any world size).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue

__all__ = ["RANK_LABEL", "RANK_STATISTICS", "RankSeriesLimit", "sum_over_ranks"]

RANK_LABEL = "rank"
"""The label of a value per rank."""
RANK_STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "min": min,
    "median": statistics.median,
    "max": max,
}
"""What a gauge per rank becomes above the limit: each statistic over ranks, by name."""


class RankSeriesLimit:
    """What a run of `world_size` ranks exports of its values per rank (see the module).

    `describe()` turns the descriptors of a metric tree into those exported and remembers which
    names carry values per rank; `derive()` turns each report's values the same way.
    """

    def __init__(self, world_size: int, max_rank_series: int) -> None:
        self.world_size = world_size
        self.max_rank_series = max_rank_series
        self.per_rank_series = world_size <= max_rank_series
        """Whether values per rank are exported as one series per rank."""
        self._kinds: dict[str, MetricKind] = {}

    def describe(self, described: Sequence[MetricDescriptor]) -> list[MetricDescriptor]:
        """The descriptors exported for `described`."""
        out: list[MetricDescriptor] = []
        for descriptor in described:
            if descriptor.label_name != RANK_LABEL or descriptor.kind is MetricKind.HISTOGRAM:
                out.append(descriptor)
                continue
            self._kinds[descriptor.name] = descriptor.kind
            if self.per_rank_series:
                out.append(descriptor)
            elif descriptor.kind is MetricKind.COUNTER:
                total = f"{descriptor.description or descriptor.name}, total over ranks"
                out.append(MetricDescriptor(descriptor.name, MetricKind.COUNTER, descriptor.unit, total))
            else:
                out.extend(
                    MetricDescriptor(
                        f"{descriptor.name}/{stat}", MetricKind.GAUGE, descriptor.unit, f"{stat} over ranks"
                    )
                    for stat in RANK_STATISTICS
                )
        return out

    def derive(self, window: dict[str, ReportValue]) -> None:
        """Derive what is exported from the values per rank of one report, in place.

        Every rank's value is kept as it is, NaN and +-Inf included (a rank that fed a NaN, or a
        gauge's rank that reported nothing in the window, is NaN): a window never leaves a rank or a
        statistic out. Over ranks, a counter's total is NaN if any rank's is; a gauge's min, median and
        max order +-Inf and leave NaN ranks out, and are NaN when no rank has a value."""
        if self.per_rank_series:
            return
        for name, kind in self._kinds.items():
            values = window.get(name)
            if not isinstance(values, Mapping):
                continue
            del window[name]
            if kind is MetricKind.COUNTER:
                window[name] = sum_over_ranks(values.values())
                continue
            ordered = [value for value in values.values() if not math.isnan(value)]
            for stat, reduce in RANK_STATISTICS.items():
                window[f"{name}/{stat}"] = reduce(ordered) if ordered else math.nan


def sum_over_ranks(values: Iterable[float]) -> float:
    """A counter's total over ranks: exact for finite values; NaN or +-Inf as float addition gives
    it otherwise."""
    values = list(values)
    return math.fsum(values) if all(map(math.isfinite, values)) else sum(values)
