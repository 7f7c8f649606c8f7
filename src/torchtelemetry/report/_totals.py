"""Running totals: counters and histograms are reported cumulatively, across windows and restarts."""

from __future__ import annotations

import itertools
import json
import logging
import operator
from collections.abc import Collection, Mapping
from typing import Any

from torchtelemetry.report._ranks import sum_over_ranks
from torchtelemetry.report._values import HistogramValue, ReportValue

__all__ = ["RunningTotals", "difference"]

logger = logging.getLogger(__name__)


class RunningTotals:
    """The running total of every counter and histogram of a run; the one place they are kept.

    A window carries what happened during it; `add()` folds it into the totals and returns what
    is reported: totals for the names in `cumulative`, the window's own value for the others.
    `state_dict()` / `load_state_dict()` carry the totals over a restart. An exporter that
    prefers deltas gets `difference()`s of these totals (see `torchtelemetry.export.Temporality`).
    """

    def __init__(self, cumulative: Collection[str]) -> None:
        self.cumulative = frozenset(cumulative)
        """Names reported as running totals (counters and histograms)."""
        self._totals: dict[str, ReportValue] = {}

    def add(self, window: Mapping[str, ReportValue]) -> dict[str, ReportValue]:
        """Fold one window's values in; returns the window with totals in place of cumulative names."""
        reported = dict(window)
        totals = self._totals
        for name in self.cumulative & window.keys():
            value, total = window[name], totals.get(name)
            reported[name] = totals[name] = (
                total + value if type(value) is float and type(total) is float else _sum(name, total, value)
            )
        return reported

    def state_dict(self) -> str:
        """The totals as one JSON string.

        `torch.distributed.checkpoint` loads only the keys of the state dict it loads into, and a
        fresh run cannot know which counters (or label values) the saved run had.
        """
        return json.dumps({name: _saved(total) for name, total in self._totals.items()})

    def load_state_dict(self, saved: str) -> None:
        """Restore totals written by `state_dict()`; totals of names no longer cumulative here (a
        metric removed from the tree, or no longer a counter) are left out with a logged warning."""
        totals = {name: _restored(total) for name, total in json.loads(saved).items()}
        removed = sorted(set(totals) - self.cumulative)
        if removed:
            logger.warning(
                "the checkpoint holds running totals of %s, which are not counters or histograms of "
                "this run; they are left out",
                removed,
            )
        self._totals = {name: total for name, total in totals.items() if name in self.cumulative}


def difference(total: ReportValue, earlier: ReportValue) -> ReportValue | None:
    """What `total` added to `earlier` (both running totals of one name); None if `earlier` is not
    an earlier total of it (a shape or bucket change, or a count that went down)."""
    if isinstance(total, HistogramValue):
        if not isinstance(earlier, HistogramValue) or earlier.bounds != total.bounds:
            return None
        counts = tuple(now - before for now, before in zip(total.counts, earlier.counts, strict=True))
        if min(counts, default=0.0) < 0 or total.count < earlier.count:
            return None
        return HistogramValue(
            total.bounds, counts, total.sum - earlier.sum, total.count - earlier.count, total.exemplar
        )
    if isinstance(total, Mapping):
        if not isinstance(earlier, Mapping):
            return None
        added = {label: count - earlier.get(label, 0.0) for label, count in total.items()}
        return None if min(added.values(), default=0.0) < 0 else added
    if isinstance(earlier, (HistogramValue, Mapping)) or float(total) < float(earlier):
        return None
    return float(total) - float(earlier)


def _sum(name: str, total: ReportValue | None, value: ReportValue) -> ReportValue:
    if isinstance(value, HistogramValue):
        if not isinstance(total, HistogramValue):
            return value
        return HistogramValue(
            bounds=value.bounds,
            counts=tuple(itertools.starmap(operator.add, zip(total.counts, value.counts, strict=True))),
            sum=total.sum + value.sum,
            count=total.count + value.count,
            exemplar=value.exemplar,  # the newest window's, as Prometheus and OTLP show one
        )
    if type(value) is dict or isinstance(value, Mapping):  # a dict first: no ABC check
        if isinstance(total, float):
            logger.warning(
                "%s: the running total over ranks (%s, restored from a run with values per rank above "
                "max_rank_series) cannot be split per rank; each rank's total starts from 0, exported "
                "as a counter reset",
                name,
                total,
            )
        totals = dict(total) if type(total) is dict or isinstance(total, Mapping) else {}
        for label, count in value.items():
            totals[label] = totals.get(label, 0.0) + count
        return totals
    if isinstance(total, Mapping):  # restored per rank, now exported over ranks: each rank's total counts
        total = sum_over_ranks(total.values())
    return (total if isinstance(total, float) else 0.0) + float(value)


def _saved(total: ReportValue) -> Any:
    """A running total as plain Python containers (checkpoint formats need no custom classes)."""
    if isinstance(total, HistogramValue):
        return {
            "bounds": list(total.bounds),
            "counts": list(total.counts),
            "sum": total.sum,
            "count": total.count,
        }
    return dict(total) if isinstance(total, Mapping) else float(total)


def _restored(saved: Any) -> ReportValue:
    if isinstance(saved, Mapping) and "bounds" in saved:
        return HistogramValue(
            bounds=tuple(saved["bounds"]),
            counts=tuple(saved["counts"]),
            sum=saved["sum"],
            count=saved["count"],
        )
    return dict(saved) if isinstance(saved, Mapping) else float(saved)
