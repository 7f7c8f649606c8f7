"""The health sentinel: exact counts of non-finite values fed to the metrics it watches.

The sentinel wraps a watched metric's `update` (keeping its signature) so that the non-finite
entries (NaN, +-Inf) of its first argument, in any form a metric takes (tensors of any dtype,
Python numbers, numpy scalars and arrays, lists), are counted before the metric takes or refuses
the value: on the device for tensors, into a per-window counter that rides the window's collective
(no host sync, no extra collective), on the host for host data. The value itself is left to the
metric's `nan_policy`; nothing is filtered or replaced. The counts are kept by metric path (sorted,
the same on every rank whatever order the paths were given in). Per window, labelled by the
metric's path:

- `train/nonfinite/count`: a counter, the run's total over ranks (exported from the first window,
  zero until something is seen, so that `increase()` sees the first one);
- `train/nonfinite/first_rank` and `first_step`: the lowest rank that saw one in the first window
  that had any, and that window's last step (exported once known, kept across restarts).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from torchtelemetry.metric import (
    DEFAULT_STATE_DTYPE,
    Metric,
    MetricAccumulator,
    MetricKind,
    ReduceOp,
    nonfinite_count,
)
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming, by_index

__all__ = ["CountingUpdate", "NonFiniteCounts", "NonFiniteSentinel", "host_nonfinite", "nonfinite_count"]

STATE = "train/nonfinite/window"
COUNT = "train/nonfinite/count"
FIRST_RANK = "train/nonfinite/first_rank"
FIRST_STEP = "train/nonfinite/first_step"

logger = logging.getLogger(__name__)


class NonFiniteCounts(Metric):
    """Non-finite values seen per watched metric (SUM) and the lowest rank that saw one (MIN)."""

    keyed_states: ClassVar[Mapping[str, str]] = {"counts": "paths", "first_rank": "paths"}

    def __init__(self, world_size: int, rank: int, paths: Sequence[str]) -> None:
        super().__init__()
        self.rank = rank
        self.paths = tuple(paths)
        """The watched metric paths, one entry of each state per path, in this order."""
        watched = len(self.paths)
        self.counts = MetricAccumulator(torch.zeros(watched), ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE)
        self.first_rank = MetricAccumulator(
            torch.full((watched,), math.inf), ReduceOp.MIN, dtype=DEFAULT_STATE_DTYPE
        )
        self._host = [0] * watched
        self._seen_by = torch.tensor(float(rank), dtype=DEFAULT_STATE_DTYPE)
        self._unseen = torch.tensor(math.inf, dtype=DEFAULT_STATE_DTYPE)

    def count(self, index: int, value: Any) -> None:
        """Count the non-finite entries of `value`, in whatever form a metric takes it: on the
        device for tensors (no sync; a 0-d one staged with the step's updates when bound, a batch
        with one temporary the size of the input), on the host for host data (Python numbers,
        numpy scalars and arrays, lists)."""
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():  # integers and booleans never are
                self.counts.count_nonfinite_at(index, value)
        elif isinstance(value, float):  # Python floats and numpy float64
            if not math.isfinite(value):
                self._host[index] += 1
        elif not isinstance(value, int):
            self._host[index] += host_nonfinite(value)

    def flush(self) -> None:
        """Add the host counts; mark this rank in `first_rank` where it saw any (the window's local
        state starts at +inf, and only this rank writes to it): on the CPU the counts are read in host
        memory (a bound collector's buffer) and the marks staged with the window's other host values
        (no op of its own); on a device by one `where` over the counts (no host read)."""
        for index, count in enumerate(self._host):
            if count:
                self.counts.add_at(index, count)
        self._host = [0] * len(self._host)
        counts = self.counts.host_entries()
        if counts is None:
            torch.where(self.counts.local > 0, self._seen_by, self._unseen, out=self.first_rank.local)
            return
        for index, count in enumerate(counts):
            if count > 0:
                self.first_rank.update_at(index, float(self.rank))

    def configuration(self) -> dict[str, Any]:
        """The paths: ranks must watch the same ones (any order: the sentinel sorts them)."""
        return {**super().configuration(), "paths": list(self.paths)}

    def compute(self) -> dict[str, torch.Tensor]:
        """The state itself, no copy: a window reads it into its report at once."""
        return {"count": self.counts.value, "first_rank": self.first_rank.value}


class CountingUpdate:
    """A metric's `update` that first counts the non-finite entries of its first argument (so a
    value the metric then refuses, under nan_policy="error", is counted too). Its signature is the
    update's own: the first argument is counted whether given by position or by name."""

    def __init__(self, update: Any, counts: NonFiniteCounts, index: int) -> None:
        functools.update_wrapper(self, update)
        self.update = update
        self.counts = counts
        self.index = index
        parameters = list(inspect.signature(update).parameters.values())
        first = parameters[0] if parameters else None
        self._first: str | None = first.name if first is not None and first.kind in _NAMED else None
        """The name of the counted argument when passed by keyword (None: by position only)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            self.counts.count(self.index, args[0])
        elif self._first in kwargs:
            self.counts.count(self.index, kwargs[self._first])
        return self.update(*args, **kwargs)


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def host_nonfinite(value: Any) -> int:
    """The non-finite entries of host data (numpy scalars and arrays, nested lists); 0 for what no
    metric takes (it refuses it itself). Reads host memory only, never a device's."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return 0
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0
    return int(nonfinite_count(tensor))


class NonFiniteSentinel(Signal):
    """Counts the non-finite values fed to the metrics at `paths` (see the module)."""

    name = "nonfinite"
    flush_reads_state = True
    event_names = frozenset({FIRST_RANK, FIRST_STEP})

    def __init__(self, context: SignalContext, watched: Mapping[str, Metric]) -> None:
        super().__init__(context)
        self.paths = tuple(sorted(watched))
        """The watched paths, sorted: positions in the window's state mean the same path on every rank."""
        self.counts = NonFiniteCounts(context.world_size, context.rank, self.paths).to(context.device)
        self._watched = {path: watched[path] for path in self.paths}
        for index, metric in enumerate(self._watched.values()):
            metric.update = CountingUpdate(metric.update, self.counts, index)  # type: ignore[method-assign]
        self._first: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def metrics(self) -> dict[str, Metric]:
        return {STATE: self.counts} if self.paths else {}

    def descriptors(self) -> list[MetricDescriptor]:
        if not self.paths:
            return []
        return [
            MetricDescriptor(COUNT, MetricKind.COUNTER, "", "Non-finite values fed to the metric", "metric"),
            MetricDescriptor(
                FIRST_RANK, MetricKind.GAUGE, "", "Lowest rank that saw the first non-finite value", "metric"
            ),
            MetricDescriptor(
                FIRST_STEP,
                MetricKind.GAUGE,
                "",
                "Last step of the first window with a non-finite value",
                "metric",
            ),
        ]

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self.paths:
            self.counts.flush()

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        counts = by_index(window.pop(f"{STATE}/count", None))
        first_ranks = by_index(window.pop(f"{STATE}/first_rank", None))
        if not self.paths:
            return
        window[COUNT] = {path: counts.get(index, 0.0) for index, path in enumerate(self.paths)}
        with self._lock:
            for index, path in enumerate(self.paths):
                rank = first_ranks.get(index, math.inf)
                if path not in self._first and math.isfinite(rank):
                    self._first[path] = (rank, float(timing.step))
            if self._first:
                window[FIRST_RANK] = {path: rank for path, (rank, _) in self._first.items()}
                window[FIRST_STEP] = {path: step for path, (_, step) in self._first.items()}

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"first": {path: list(first) for path, first in self._first.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("first", {})
        unwatched = sorted(set(saved) - set(self.paths))
        if unwatched:
            logger.warning(
                "the checkpoint holds the first non-finite value of %s, which this run does not watch "
                "(TelemetryConfig.nonfinite); left out",
                unwatched,
            )
        with self._lock:
            self._first = {
                path: (float(rank), float(step)) for path, (rank, step) in saved.items() if path in self.paths
            }

    def close(self) -> None:
        """Take this sentinel's counting out of the watched metrics' `update` (another sentinel's
        stays, wherever it wraps)."""
        for metric in self._watched.values():
            _unwrap(metric, self.counts)


def _unwrap(metric: Metric, counts: NonFiniteCounts) -> None:
    outer: CountingUpdate | None = None
    current = metric.__dict__.get("update")
    while isinstance(current, CountingUpdate):
        if current.counts is counts:
            if outer is not None:
                outer.update = current.update
            elif getattr(current.update, "__self__", None) is metric:  # the class's own update again
                del metric.__dict__["update"]
            else:
                metric.__dict__["update"] = current.update
            return
        outer, current = current, current.update


def watched_metrics(leaves: Sequence[tuple[str, Metric]], paths: Sequence[str] | None) -> dict[str, Metric]:
    """The metrics to watch: those at `paths` (each must exist), or with None every metric whose
    name ends in `loss` (`train/loss`, `val/loss`, `train/nll_loss`)."""
    by_path = dict(leaves)
    if paths is None:
        return {path: metric for path, metric in leaves if path.rsplit("/", 1)[-1].endswith("loss")}
    if isinstance(paths, str):
        raise TypeError(
            f"TelemetryConfig.nonfinite must be a sequence of metric paths, got the string {paths!r}"
        )
    unknown = [path for path in paths if path not in by_path]
    if unknown:
        raise ValueError(
            f"TelemetryConfig.nonfinite: {unknown} are not metric paths of this Telemetry "
            f"(its metrics: {sorted(by_path)})"
        )
    return {path: by_path[path] for path in dict.fromkeys(paths)}
