"""Walking a PyTree of Metrics: each Metric with its path (`train/loss`), each accumulator with its name."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from torchtelemetry.metric._accumulator import MetricAccumulator
from torchtelemetry.metric._base import Metric

__all__ = ["metric_leaves", "named_accumulators"]


def metric_leaves(metrics: Any, *, op: str = "sync_metrics") -> list[tuple[str, Metric]]:
    """The Metrics of a PyTree (dict, list, tuple, nested) with their paths, e.g. `train/loss`."""
    leaves, _ = pytree.tree_flatten_with_path(metrics)
    named = []
    for path, leaf in leaves:
        # Only a bare Metric (no path) is named after itself: an empty key stays empty, and naming
        # rules reject it instead of renaming it silently.
        name = (
            "/".join(str(_key_name(key)) for key in path)
            if path
            else (getattr(leaf, "name", None) or "metric")
        )
        if not isinstance(leaf, Metric):
            raise TypeError(f"{op}: {name!r} is a {type(leaf).__name__}, expected a Metric")
        named.append((name, leaf))
    return named


def _key_name(key: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def named_accumulators(metrics: Any, *, op: str = "sync_metrics") -> dict[str, MetricAccumulator]:
    """Every accumulator of a PyTree of Metrics, named `path.attribute`."""
    return {
        f"{name}.{attr}": accumulator
        for name, metric in metric_leaves(metrics, op=op)
        for attr, accumulator in metric.accumulators.items()
    }
