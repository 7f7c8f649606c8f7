"""`MetricBinding`: the one place a metric is collected from, told when the metric changes.

A collector keeps every local state of its metrics in flat buffers of its own (`adopt`) and
resets them at each collection. So a metric object can be collected in one place only: a
second collector (or a second path of the same tree) would read states the first one resets,
and report nothing. `claim()` refuses that, naming the metric and both places.

A metric tells only its own binding when its layout changes (an accumulator registered,
replaced, dropped or moved by `to()`); nothing else in the process invalidates a collector's
storage, so a CUDA graph captured after `bind()` keeps writing where the collector reads.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtelemetry.metric._base import Metric

__all__ = ["MetricBinding"]


def _caller() -> str:
    """`file:line` of the nearest frame outside torchtelemetry (where the user bound the metrics)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torchtelemetry"):
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class MetricBinding:
    """The claim of one owner (e.g. an `AsyncMetricCollector`) on a set of metrics.

    `stale` turns True when any claimed metric changes its layout; the owner rebuilds what
    depends on it and calls `attach()` again. The claim lapses with `release()` or when the
    owner is garbage collected.
    """

    __slots__ = ("__weakref__", "_owner", "_paths", "place", "stale")

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self.place = f"the {type(owner).__name__} bound at {_caller()}"
        """Who holds the claim, for error messages."""
        self.stale = False
        self._paths: dict[int, str] = {}

    @property
    def active(self) -> bool:
        """Whether the claim holds: claimed, not released, owner alive."""
        return bool(self._paths) and self._owner() is not None

    def claim(self, named: Sequence[tuple[str, Metric]], *, op: str) -> None:
        """Claim every metric of `named` (path, metric) for the owner.

        Raises `ValueError` naming the metric and both places if a metric sits at two paths of
        `named`, or is claimed by another live owner. Nothing is claimed then.
        """
        self.place = f"the {type(self._owner()).__name__} bound at {_caller()}"
        paths: dict[int, str] = {}
        for path, metric in named:
            first = paths.setdefault(id(metric), path)
            if first != path:
                raise ValueError(
                    f"{op}: the same {metric.display_name()} object is at {first!r} and {path!r}; each "
                    "collection resets a metric, so one path would always report nothing. Build one "
                    "metric per path"
                )
            other = metric.__dict__.get("_binding")
            if other is not None and other is not self and other.active:
                raise ValueError(
                    f"{op}: metric {path!r} ({metric.display_name()}) is already collected by "
                    f"{other.place} (as {other._paths.get(id(metric))!r}); each collection resets a "
                    "metric, so one of the two would report nothing. Call unbind() (or close()) on the "
                    "other first, or give each its own metric object"
                )
        self._paths = paths
        self.attach(named)

    def attach(self, named: Sequence[tuple[str, Metric]]) -> None:
        """Point every claimed metric and its accumulators at this binding again (after a rebuild)."""
        for _, metric in named:
            object.__setattr__(metric, "_binding", self)
            for accumulator in metric._accumulators.values():
                accumulator._binding = self
        self.stale = False

    def release(self, named: Sequence[tuple[str, Metric]]) -> None:
        """Give the metrics back: they may be claimed elsewhere."""
        for _, metric in named:
            if metric.__dict__.get("_binding") is self:
                object.__setattr__(metric, "_binding", None)
                for accumulator in metric._accumulators.values():
                    if accumulator._binding is self:
                        accumulator._binding = None
        self._paths = {}

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """A copied or unpickled metric is bound nowhere: its binding copies as None."""
        return _unbound, ()


def _unbound() -> None:
    return None
