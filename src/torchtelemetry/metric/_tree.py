"""Walking a PyTree of Metrics: each Metric with its path (`train/loss`), each accumulator with its name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils import _pytree as pytree

from torchtelemetry.metric._accumulator import MetricAccumulator
from torchtelemetry.metric._base import Metric

__all__ = ["metric_leaves", "named_accumulators", "named_metric_leaves"]


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


def named_metric_leaves(metrics: Any, *, op: str) -> list[tuple[str, Metric]]:
    """`metric_leaves` of a tree of mappings (`{"train": {"loss": metric}}`), whose keys name every
    series. A list, a tuple or a bare Metric anywhere in it raises a `TypeError` saying where: its
    metrics would be named by position (a list exports as `0`), a name that changes with the list."""
    _require_mapping(metrics, op, "")
    return metric_leaves(metrics, op=op)


def _require_mapping(node: Any, op: str, path: str) -> None:
    if not isinstance(node, Mapping):
        where = f"{path!r} in the metric tree" if path else "the metric tree"
        if isinstance(node, Metric):
            hint = "name it: {'loss': metric}"
        elif isinstance(node, (list, tuple)):
            hint = "make it a dict of names"
        else:
            hint = "give a Metric or a dict there"
        raise TypeError(
            f"{op}: {where} is a {type(node).__name__}, not a mapping of names to Metrics; the keys of "
            f"nested dicts name the series ({{'train': {{'loss': metric}}}} -> train/loss), a list or "
            f"tuple would name them by position ('0'): {hint}"
        )
    for key, value in node.items():
        if not isinstance(value, Metric):
            _require_mapping(value, op, f"{path}/{key}" if path else str(key))


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
