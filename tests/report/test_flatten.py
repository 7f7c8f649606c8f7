"""`ResultNaming`: a metric tree's results named window after window exactly as the general path
names each result (`_entries`), its plan of a result's names made again when the result's structure
changes."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from typing import Any

import pytest

import torchtelemetry as tt
from torchtelemetry.metric import Metric
from torchtelemetry.report import HistogramValue, InvalidMetricNameError
from torchtelemetry.report._flatten import ResultNaming, _entries

LEAVES: list[tuple[str, Metric]] = [
    ("free", tt.MaxMetric()),
    ("train/hist", tt.HistogramMetric(bins=[1.0, 2.0])),
]
HISTOGRAM = {"bounds": [1.0, 2.0], "counts": [1.0, 0.0, 2.0], "sum": 7.5, "count": 3.0}


class Half(float):
    """A float of a subclass (as numpy's float64 is): the general path takes it."""


def _general(leaves: Sequence[tuple[str, Metric]], results: Sequence[Any]) -> list[tuple[str, Any]]:
    return [
        (descriptor.name, value)
        for (name, metric), result in zip(leaves, results, strict=True)
        for descriptor, value in _entries(name, metric, result)
    ]


# One metric's result, window after window: each form, and each change of form, of a result.
WINDOWS = [
    1.5,
    3,
    True,
    Half(0.5),
    [1.0, 2, False],
    [],
    [Half(1.0), 2.0],
    {"a": 1.0, "b": [1.0, 2.0], "c": {"d": 2}},
    {"a": 0.5, "b": [1.0, 2.0, 3.0, 4.0, 5.0], "c": {"d": 3.0}},  # more labels
    {"b": 1.0, "a": 2.0},  # the same keys in another order: named in that order
    {"a": {"e": [1, 2]}, "c": 1},
    {1: 2.0, "x": {2: 3.0}},  # keys that are not strings
    collections.OrderedDict(a=1.0),  # a Mapping, not a dict
    {"a": 1.0, "b": [1.0, 2.0], "c": {"d": 2}},  # as before: the plan made then
]


def test_each_window_is_named_as_the_general_path_names_it() -> None:
    naming = ResultNaming(LEAVES)
    for result in WINDOWS:
        expected = _general(LEAVES, [result, HISTOGRAM])
        assert list(naming.flatten([result, HISTOGRAM]).items()) == expected, result
    assert expected[-1] == ("train/hist", HistogramValue((1.0, 2.0), (1.0, 0.0, 2.0), 7.5, 3.0))


@pytest.mark.parametrize(
    ("result", "error"),
    [
        ({"bad name": 1.0}, InvalidMetricNameError),
        ({"a": {"ok": 1.0, "": 2.0}}, InvalidMetricNameError),
        ({"a": "text", "bad name": 1.0}, TypeError),  # the first entry's error, as the general path's
        ({"a": 1.0, "b": ["x"]}, TypeError),
        (None, TypeError),
    ],
)
def test_a_result_that_cannot_be_named_raises_the_general_paths_error(result: Any, error: type) -> None:
    naming = ResultNaming(LEAVES)
    naming.flatten([{"a": 1.0, "b": [1.0]}, HISTOGRAM])  # planned before
    with pytest.raises(error) as general:
        _general(LEAVES, [result, HISTOGRAM])
    with pytest.raises(error, match=f"^{re.escape(str(general.value))}$"):
        naming.flatten([result, HISTOGRAM])


def test_a_histogram_result_without_its_parts_names_the_metric() -> None:
    with pytest.raises(TypeError, match="'train/hist': a histogram metric's compute"):
        ResultNaming(LEAVES).flatten([1.0, {"bounds": [1.0]}])
