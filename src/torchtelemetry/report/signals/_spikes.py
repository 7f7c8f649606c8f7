"""Spike scores of the watched metrics (the losses by default), as OLMo-core flags loss spikes.

Per window and watched metric whose window value is one finite number: `score` = (value - mean) /
standard deviation of its last `windows` window values (once `MIN_HISTORY` are known); the value
is a spike when its score exceeds `sigma`. Exported, labelled by the metric's path:

- `train/spike/score`: the window's score (a gauge);
- `train/spike/count`: spikes (a counter, zero until the first, so that `increase()` sees it).

Defaults: `sigma` = 6 over `windows` = 32 windows (OLMo-core: 6 sigma over 128 steps; at `every=10`
32 windows are 320 steps). The history is checkpointed with the telemetry, so a restart neither
forgets the loss level nor scores its first windows against nothing. Non-finite values (counted by
the sentinel) are neither scored nor kept.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["MIN_HISTORY", "Spikes", "mean_and_deviation"]

MIN_HISTORY = 8
"""Window values a metric needs before its values are scored."""
SCORE = "train/spike/score"
COUNT = "train/spike/count"


class Spikes(Signal):
    """Spike scores of the metrics at `paths` (see the module)."""

    name = "spikes"

    def __init__(self, context: SignalContext, paths: Sequence[str], *, sigma: float, windows: int) -> None:
        super().__init__(context)
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"TelemetryConfig.spike_sigma must be a positive number, got {sigma}")
        if windows < MIN_HISTORY:
            raise ValueError(f"TelemetryConfig.spike_windows must be at least {MIN_HISTORY}, got {windows}")
        self.paths = tuple(paths)
        self.sigma = sigma
        self.windows = windows
        self._history: dict[str, collections.deque[float]] = {
            path: collections.deque(maxlen=windows) for path in self.paths
        }
        self._lock = threading.Lock()

    def descriptors(self) -> list[MetricDescriptor]:
        if not self.paths:
            return []
        return [
            MetricDescriptor(
                SCORE, MetricKind.GAUGE, "", "Standard deviations above the mean of recent windows", "metric"
            ),
            MetricDescriptor(
                COUNT, MetricKind.COUNTER, "", f"Windows more than {self.sigma:g} sigma up", "metric"
            ),
        ]

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        scores: dict[str, float] = {}
        with self._lock:
            for path in self.paths:
                value = window.get(path)
                if not isinstance(value, float) or not math.isfinite(value):
                    continue
                history = self._history[path]
                # A constant history scores nothing (its float mean need not be its value).
                if len(history) >= MIN_HISTORY and max(history) > min(history):
                    middle, spread = mean_and_deviation(history)
                    scores[path] = (value - middle) / spread
                history.append(value)
        if not self.paths:
            return
        window[COUNT] = {path: float(scores.get(path, 0.0) > self.sigma) for path in self.paths}
        if scores:
            window[SCORE] = scores

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"history": {path: list(values) for path, values in self._history.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._lock:
            for path, values in state.get("history", {}).items():
                if path in self._history:
                    self._history[path].clear()
                    self._history[path].extend(float(value) for value in values)


def mean_and_deviation(values: Collection[float]) -> tuple[float, float]:
    """The mean and the population standard deviation of finite `values` (not empty) in floats, from
    correctly rounded sums (`statistics.pstdev` sums exact fractions, several Python calls a value).
    The deviations are scaled by the largest before they are squared, so that none underflows or
    overflows: values that are not all equal have a deviation above 0."""
    count = len(values)
    middle = math.fsum(values) / count
    deviations = [value - middle for value in values]
    scale = max(map(abs, deviations))
    if scale == 0:
        return middle, 0.0
    squares = [(deviation / scale) ** 2 for deviation in deviations]
    return middle, scale * math.sqrt(math.fsum(squares) / count)
