"""From a metric tree and its results to named values and their descriptors."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtelemetry.metric import Metric, MetricKind, metric_leaves
from torchtelemetry.report._naming import validate_path
from torchtelemetry.report._values import HistogramValue, MetricDescriptor, ReportValue

__all__ = ["describe_metrics", "flatten_results", "to_python"]


def to_python(tree: Any) -> Any:
    """Same structure, every tensor leaf as a Python scalar (0-d) or nested list: a local `compute()`'s
    results as `flatten_results` takes them."""
    return pytree.tree_map(_leaf_to_python, tree)


def _leaf_to_python(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.item() if leaf.dim() == 0 else leaf.tolist()
    return leaf


def describe_metrics(metrics: Any) -> list[MetricDescriptor]:
    """Descriptors of every exported name of a PyTree of Metrics; names are validated.

    The structure of each metric's results is read from one local `compute()`.
    """
    descriptors = []
    for name, metric in metric_leaves(metrics, op="describe_metrics"):
        validate_path(name)
        result = to_python(metric.compute())
        descriptors.extend(descriptor for descriptor, _ in _entries(name, metric, result))
    return descriptors


def flatten_results(metrics: Sequence[tuple[str, Metric]], results: Sequence[Any]) -> dict[str, ReportValue]:
    """Named values of one report: `results[i]` is the Python result of `metrics[i]`."""
    flat: dict[str, ReportValue] = {}
    for (name, metric), result in zip(metrics, results, strict=True):
        if type(result) is float and metric.kind is not MetricKind.HISTOGRAM:  # most metrics: named as is
            flat[name] = result
        else:
            flat.update((descriptor.name, value) for descriptor, value in _entries(name, metric, result))
    return flat


def _entries(name: str, metric: Metric, result: Any) -> Iterator[tuple[MetricDescriptor, ReportValue]]:
    def descriptor(label_name: str | None = None) -> MetricDescriptor:
        return MetricDescriptor(name, metric.kind, metric.unit, metric.description, label_name)

    if metric.kind is MetricKind.HISTOGRAM:
        yield descriptor(), _histogram(name, result)
    elif isinstance(result, bool | int | float):
        yield descriptor(), float(result)
    elif isinstance(result, list) and all(isinstance(entry, bool | int | float) for entry in result):
        yield descriptor(metric.label_name), {str(i): float(entry) for i, entry in enumerate(result)}
    elif isinstance(result, Mapping):
        for key, entry in result.items():
            sub_name = f"{name}/{key}"
            validate_path(sub_name)
            yield from _entries(sub_name, metric, entry)
    else:
        raise TypeError(
            f"{metric.display_name()} ({name!r}): compute() returned {type(result).__name__}; exporters take "
            "scalars, 1-D tensors and dicts of those"
        )


def _histogram(name: str, result: Any) -> HistogramValue:
    try:
        return HistogramValue(
            bounds=tuple(float(b) for b in result["bounds"]),
            counts=tuple(float(c) for c in result["counts"]),
            sum=float(result["sum"]),
            count=float(result["count"]),
        )
    except (KeyError, TypeError) as error:
        raise TypeError(
            f"{name!r}: a histogram metric's compute() must return bounds, counts, sum and count"
        ) from error
