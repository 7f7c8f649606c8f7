"""Per-layer statistics' window state and request: the names the layers export, `LayerState` (what a
window reduces per layer name: shares of the sums of squares, and where each pass first met a
non-finite value, encoded as `step * RANK_CODES + rank`) and `LayerWatch` (what
`Telemetry.watch_layers` is asked, checked when built). The signal that fills and derives them is
`_layers`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from torchtelemetry.metric import DEFAULT_STATE_DTYPE, Metric, MetricAccumulator, ReduceOp
from torchtelemetry.sync import GroupLike

__all__ = [
    "DEFAULT_LAYER_STATS",
    "FIRST_NONFINITE",
    "FIRST_NONFINITE_RANK",
    "GRAD_NORM",
    "LAYER_STATS",
    "PARAM_NORM",
    "PASSES",
    "RANK_CODES",
    "STATE",
    "LayerState",
    "LayerWatch",
]

STATE = "train/layer/window"
GRAD_NORM = "train/layer/grad_norm"
PARAM_NORM = "train/layer/param_norm"
FIRST_NONFINITE = "train/layer/first_nonfinite"
FIRST_NONFINITE_RANK = "train/layer/first_nonfinite_rank"
PASSES = ("forward", "backward")
LAYER_STATS = {"grad_norm": GRAD_NORM, "param_norm": PARAM_NORM}
"""The statistics `watch_layers(stats=)` takes, and the names they export."""
DEFAULT_LAYER_STATS = ("grad_norm", "param_norm")
RANK_CODES = 1 << 20
"""A first non-finite value is kept as `step * RANK_CODES + rank`: a world size does not change it."""


class LayerState(Metric):
    """A window's per-layer state: shares of the sums of squares (SUM) and the first non-finite
    value's `step * RANK_CODES + rank` per pass (MIN), one row per layer name."""

    keyed_states: ClassVar[Mapping[str, str]] = {
        "grad_sumsq": "layers",
        "param_sumsq": "layers",
        "first": "layers",
    }

    def __init__(self) -> None:
        super().__init__()
        self.resize((), torch.device("cpu"))

    def resize(self, layers: Sequence[str], device: torch.device) -> None:
        """One row per layer of `layers` from now on (a collector holding this state rebuilds its
        layout at its next collection, and checks it across the ranks then)."""
        self.layers = tuple(layers)
        count = len(self.layers)
        sums = torch.zeros(count)
        self.grad_sumsq = MetricAccumulator(sums, ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE, device=device)
        self.param_sumsq = MetricAccumulator(sums, ReduceOp.SUM, dtype=DEFAULT_STATE_DTYPE, device=device)
        first = torch.full((count, len(PASSES)), math.inf)
        self.first = MetricAccumulator(first, ReduceOp.MIN, dtype=DEFAULT_STATE_DTYPE, device=device)

    def configuration(self) -> dict[str, Any]:
        """The layer names: ranks must watch the same ones."""
        return {**super().configuration(), "layers": list(self.layers)}

    def compute(self) -> dict[str, torch.Tensor]:
        """Views of the state, no copy: a window reads them into its report at once."""
        first = self.first.value
        return {
            "grad_sumsq": self.grad_sumsq.value,
            "param_sumsq": self.param_sumsq.value,
            **{f"first_{name}": column for name, column in zip(PASSES, first.unbind(1), strict=True)},
        }


@dataclass(frozen=True, slots=True)
class LayerWatch:
    """What `Telemetry.watch_layers` is asked to watch (its arguments, checked when built), and the
    group the windows are reduced over."""

    layers: Sequence[str] | None = None
    stats: Sequence[str] = DEFAULT_LAYER_STATS
    every: int | None = None
    nonfinite: bool = True
    group: GroupLike = None

    def __post_init__(self) -> None:
        stats = self.stats
        if isinstance(stats, str) or not set(stats) <= LAYER_STATS.keys():
            raise ValueError(
                f"Telemetry.watch_layers: stats must be a sequence of {sorted(LAYER_STATS)}, got {stats!r}"
            )
        every = self.every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"Telemetry.watch_layers: every must be a positive number of steps or None, got {every!r}"
            )
