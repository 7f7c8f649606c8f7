"""docs/metrics.md's example metric, run as the page shows it: its doctest, two gloo ranks, a
`Telemetry` window, the checkpoint round trip, bad input and the no-host-sync rule."""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.hostsync import NoHostSync
from tests.metric.examples import build, feed

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
PREDS = [[1.0, 2.0, 3.0], [0.5, -1.0, 4.0, 2.0]]
TARGET = [[1.5, 2.0, 1.0], [0.0, 1.0, 4.0, 5.0]]
"""Rank r updates with PREDS[r] and TARGET[r]."""


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def _example() -> type[tt.Metric]:
    """The page's first snippet, executed: its MeanSquaredErrorMetric class."""
    namespace: dict[str, Any] = {"__name__": "docs_metrics_example"}
    exec(compile(_snippets()[0], str(DOC), "exec"), namespace)
    return namespace["MeanSquaredErrorMetric"]


def _expected(*ranks: int) -> float:
    errors = [(p - t) ** 2 for r in ranks for p, t in zip(PREDS[r], TARGET[r], strict=True)]
    return sum(errors) / len(errors)


def test_the_docstring_example_runs_as_a_doctest() -> None:
    metric_class = _example()
    globs = {"torch": torch, "MeanSquaredErrorMetric": metric_class}
    (test,) = [test for test in doctest.DocTestFinder().find(metric_class, globs=globs) if test.examples]
    failed, attempted = doctest.DocTestRunner().run(test)
    assert attempted == 3 and failed == 0


def test_every_snippet_of_the_page_defines_a_working_metric() -> None:
    for code in _snippets():
        namespace: dict[str, Any] = {"__name__": "docs_metrics_snippet"}
        exec(compile(code, str(DOC), "exec"), namespace)
        (metric_class,) = [
            value
            for value in namespace.values()
            if isinstance(value, type) and issubclass(value, tt.Metric) and value is not tt.Metric
        ]
        assert metric_class.batched is not None, f"{metric_class.__name__} shows the batched rule"


def test_one_process_result_checkpoint_and_empty_state() -> None:
    metric_class = _example()
    metric = metric_class()
    assert torch.isnan(metric.compute()), "no element seen: 0 / 0"
    for preds, target in zip(PREDS, TARGET, strict=True):
        metric.update(torch.tensor(preds), torch.tensor(target))
    assert metric.compute().item() == pytest.approx(_expected(0, 1), rel=1e-15)
    restored = metric_class()
    restored.load_state_dict(metric.state_dict())
    assert restored.compute().item() == metric.compute().item()


def test_the_page_declares_examples_that_run() -> None:
    metric_class = _example()
    for example in metric_class.examples():
        metric = feed(build(metric_class, example), example)
        assert torch.isfinite(metric.compute()), example.form


def test_bad_input_names_the_metric_and_keeps_the_state() -> None:
    metric = _example()(name="val/mse")
    metric.update(torch.tensor(PREDS[0]), torch.tensor(TARGET[0]))
    before = {attr: acc.local.clone() for attr, acc in metric.accumulators.items()}
    with pytest.raises(ValueError, match=r"MeanSquaredErrorMetric 'val/mse': preds has shape \(3,\)"):
        metric.update(torch.tensor(PREDS[0]), torch.tensor(TARGET[1]))
    for attr, acc in metric.accumulators.items():
        assert torch.equal(acc.local, before[attr]), attr


def test_update_never_syncs_the_device() -> None:
    metric = _example()().to("meta")
    preds, target = torch.ones(4, device="meta"), torch.zeros(4, device="meta")
    with NoHostSync():
        metric.update(preds, target)


def _two_ranks(rank: int, world_size: int, path: str) -> dict[str, Any]:
    metric_class = _example()
    alone = metric_class()
    windowed = {"val": {"mse": metric_class()}}
    telemetry = tt.Telemetry(windowed, [tt.JsonlExporter(path)], every=1, run_id="mse", signals=False)
    for metric in (alone, windowed["val"]["mse"]):
        metric.update(torch.tensor(PREDS[rank]), torch.tensor(TARGET[rank]))
    telemetry.step(0)
    telemetry.close()
    return {"synced": tt.sync_and_compute(alone)}


@pytest.mark.timeout(180)
def test_two_ranks_compute_the_mean_over_both_ranks_data(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    results = run_ranks(_two_ranks, 2, str(path))
    expected = _expected(0, 1)
    assert [r["synced"] for r in results] == [pytest.approx(expected, rel=1e-15)] * 2
    (line,) = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["values"]["val/mse"] == pytest.approx(expected, rel=1e-15)
