"""What every cross-cutting suite is parametrized over: the metric classes `torchtelemetry.metric`
exports (`metric.__all__`) and the examples each declares (`Metric.examples()`).

A metric added to `metric.__all__` with its examples joins every suite that uses `EXAMPLES`: no
host sync (tests/metric/test_no_host_sync.py), bad input (tests/reliability/test_bad_input.py),
batched compute = `compute()` (tests/collect/test_window.py), checkpoint round trip and one
prologue (tests/metric/test_metrics.py), torchmetrics parity (tests/metric/test_against_torchmetrics.py),
the thread rule (tests/reliability/test_threads_and_forks.py). `PATHS` runs a suite both on a metric
of its own and on one `staged()` as a bound collector keeps it (tests/metric/test_staging.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchtelemetry import metric
from torchtelemetry.collect._transports import BoundStorage
from torchtelemetry.metric import Metric, MetricExample

METRIC_CLASSES: list[type[Metric]] = [
    cls
    for name in metric.__all__
    if isinstance(cls := getattr(metric, name), type) and issubclass(cls, Metric) and cls is not Metric
]
"""Every metric class the package exports."""

EXAMPLE_CASES: list[tuple[type[Metric], MetricExample]] = [
    (cls, example) for cls in METRIC_CLASSES for example in cls.examples()
]
"""(class, example) for every example of every exported metric class."""

EXAMPLES = [
    pytest.param(cls, example, id=f"{cls.__name__}: {example.form}") for cls, example in EXAMPLE_CASES
]
"""`EXAMPLE_CASES` as pytest parameters `(cls, example)`, each named after its class and form."""


def build(cls: type[Metric], example: MetricExample, **options: Any) -> Metric:
    """`cls` built with the example's options (and `options`)."""
    return cls(**example.options, **options)


def feed(metric: Metric, example: MetricExample, times: int = 1) -> Metric:
    """`metric` updated with the example's inputs, `times` over."""
    for _ in range(times):
        for args in example.updates:
            metric.update(*args)
    return metric


def on_device(args: tuple[Any, ...], device: torch.device | str, *, keep_0d: bool = False) -> tuple[Any, ...]:
    """`args` with every tensor moved to `device` (0-d ones kept where they are with `keep_0d`:
    a 0-d CPU tensor is accepted on any device); Python numbers and lists as they are."""
    return tuple(
        arg.to(device) if isinstance(arg, torch.Tensor) and not (keep_0d and arg.dim() == 0) else arg
        for arg in args
    )


PATHS = ["immediate", "staged"]
"""How a suite's metrics take their updates: at once (a metric of its own), or staged and applied when
the state is read (`staged`)."""


def staged(metric: Metric) -> Metric:
    """`metric` with its states kept as a bound collector keeps them (views of one flat buffer per
    bucket): its updates of float64 states are staged and applied when a state is read."""
    BoundStorage.build([("metric", metric)], world_size=1)
    return metric


def on_path(metric: Metric, path: str) -> Metric:
    """`metric` as `path` (one of `PATHS`) updates it."""
    return staged(metric) if path == "staged" else metric
