"""From a metric tree and its results to named values and their descriptors."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchtelemetry.metric import Metric, MetricKind, metric_leaves
from torchtelemetry.report._naming import InvalidMetricNameError, validate_path
from torchtelemetry.report._values import HistogramValue, MetricDescriptor, ReportValue

__all__ = ["ResultNaming", "describe_metrics", "flatten_results", "to_python"]


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
    return ResultNaming(metrics).flatten(results)


_NUMBERS = frozenset({float, int, bool})


@dataclass(frozen=True, slots=True)
class _Entries:
    """A dict result's keys (plain strings) and the checked name of each entry."""

    keys: tuple[str, ...]
    names: tuple[str, ...]


class ResultNaming:
    """`flatten_results` of one metric tree, window after window (one thread at a time): what depends
    only on the structure of the results, the checked names of a dict's entries and the labels of a
    list, is made once and again whenever that structure changes. Results of any other form (a
    `Mapping` not a dict, numbers of a subclass, a bad value) take `flatten_results`' general path,
    with its errors."""

    def __init__(self, metrics: Sequence[tuple[str, Metric]]) -> None:
        self._names = [name for name, _ in metrics]
        self._metrics = [metric for _, metric in metrics]
        self._histograms = [metric.kind is MetricKind.HISTOGRAM for _, metric in metrics]
        self._entries: dict[str, _Entries] = {}
        """By the path of each dict result (or entry) seen."""
        self._labels: tuple[str, ...] = ()
        """The labels of a list's entries, "0", "1", ...: as many as the longest list seen."""

    def flatten(self, results: Sequence[Any]) -> dict[str, ReportValue]:
        """Named values of one report: `results[i]` is the Python result of the i-th metric."""
        flat: dict[str, ReportValue] = {}
        self._put(flat, zip(self._names, self._metrics, self._histograms, results, strict=True))
        return flat

    def _put(self, flat: dict[str, ReportValue], named: Iterable[tuple[str, Metric, bool, Any]]) -> None:
        """Name each `(name, metric, whether a histogram, result)` of `named` into `flat`."""
        for name, metric, histogram, result in named:
            kind = type(result)
            if histogram:
                flat[name] = _histogram(name, result)
            elif kind is float:  # most metrics: named as is
                flat[name] = result
            elif kind is list and _NUMBERS.issuperset(map(type, result)):
                if len(result) > len(self._labels):
                    self._labels = tuple(map(str, range(len(result))))
                flat[name] = dict(zip(self._labels, map(float, result), strict=False))
            elif kind is dict:
                self._put_dict(flat, name, metric, result)
            else:
                flat.update(_named(name, metric, result))

    def _put_dict(self, flat: dict[str, ReportValue], name: str, metric: Metric, result: dict) -> None:
        entries = self._entries.get(name)
        if entries is None or entries.keys != tuple(result):
            entries = self._entries_of(name, result)
            if entries is None:
                flat.update(_named(name, metric, result))
                return
        # Equal lengths: the keys are the plan's.
        named = zip(entries.names, itertools.repeat(metric), itertools.repeat(False), result.values())
        self._put(flat, named)  # type: ignore[arg-type]

    def _entries_of(self, name: str, result: dict) -> _Entries | None:
        """The entries of dict `result` at `name`, remembered; None where a key is not a string or
        makes an illegal name (the general path raises for it, in its order)."""
        keys = tuple(result)
        if not all(type(key) is str for key in keys):
            return None
        names = tuple(f"{name}/{key}" for key in keys)
        try:
            for sub_name in names:
                validate_path(sub_name)
        except InvalidMetricNameError:
            return None
        self._entries[name] = entries = _Entries(keys, names)
        return entries


def _named(name: str, metric: Metric, result: Any) -> Iterator[tuple[str, ReportValue]]:
    return ((descriptor.name, value) for descriptor, value in _entries(name, metric, result))


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
            bounds=tuple(map(float, result["bounds"])),
            counts=tuple(map(float, result["counts"])),
            sum=float(result["sum"]),
            count=float(result["count"]),
        )
    except (KeyError, TypeError) as error:
        raise TypeError(
            f"{name!r}: a histogram metric's compute() must return bounds, counts, sum and count"
        ) from error
