"""The metric extension point: every exported metric declares examples (which every cross-cutting
suite runs, tests/metric/examples.py) and shows one in its docstring, run here as a doctest."""

from __future__ import annotations

import doctest
import sys

import pytest

from tests.metric.examples import EXAMPLES, METRIC_CLASSES, build, feed
from torchtelemetry.metric import Metric


def test_the_suites_see_every_builtin() -> None:
    names = {cls.__name__ for cls in METRIC_CLASSES}
    assert {"SumMetric", "PerRankMetric", "BinaryAUROCMetric", "HistogramMetric"} <= names
    assert len(EXAMPLES) >= 2 * len(METRIC_CLASSES)


@pytest.mark.parametrize("cls", METRIC_CLASSES, ids=lambda cls: cls.__name__)
def test_every_exported_metric_declares_examples(cls: type[Metric]) -> None:
    examples = cls.examples()
    assert examples, (
        f"{cls.__name__} declares no examples, so no cross-cutting suite (no host sync, bad input, "
        "batched compute, checkpoint, torchmetrics parity) runs it. Add to the class, in its module: "
        "`@classmethod def examples(cls) -> tuple[MetricExample, ...]: return "
        "(MetricExample('what it shows', (update args,), ..., **constructor options), ...)`, one per "
        "documented input form (docs/metrics.md, 'Examples')"
    )
    forms = [example.form for example in examples]
    assert len(set(forms)) == len(forms), f"{cls.__name__}: example forms must be unique, got {forms}"


@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_every_example_builds_and_updates(cls: type[Metric], example) -> None:
    assert example.updates, f"{cls.__name__} example {example.form!r} has no update"
    feed(build(cls, example), example).compute()


@pytest.mark.parametrize("cls", METRIC_CLASSES, ids=lambda cls: cls.__name__)
def test_every_exported_metric_docstring_example_runs(cls: type[Metric]) -> None:
    module = sys.modules[cls.__module__]
    finder = doctest.DocTestFinder(recurse=False)
    (test,) = finder.find(cls, cls.__name__, module=module, globs=dict(vars(module)))
    assert test.examples, (
        f"{cls.__name__}'s docstring has no example: add an `Example:` section with `>>>` lines that "
        "build the metric, update it and show compute()"
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failed, _ = runner.run(test)
    assert failed == 0, f"{cls.__name__}'s docstring example fails (see the output above)"
