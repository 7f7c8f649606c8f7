"""`update()` of every built-in metric compiles with `fullgraph=True` (no graph break) and matches eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.metric import named_accumulators

Inputs = Callable[[torch.Generator], tuple[Any, ...]]


def _values(gen: torch.Generator) -> tuple[Any, ...]:
    return (torch.randn(16, generator=gen, dtype=torch.float64),)


def _positive(gen: torch.Generator) -> tuple[Any, ...]:
    return (torch.rand(16, generator=gen),)


def _with_nan(gen: torch.Generator) -> tuple[Any, ...]:
    values = torch.randn(16, generator=gen)
    values[3] = float("nan")
    return (values,)


def _weighted(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.randn(16, generator=gen), torch.rand(16, generator=gen)


def _scalar_weighted(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.randn((), generator=gen), 32


def _logits(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.randn(16, 5, generator=gen), torch.randint(0, 5, (16,), generator=gen)


def _labels(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.randint(0, 5, (16,), generator=gen), torch.randint(0, 5, (16,), generator=gen)


def _ignored_labels(gen: torch.Generator) -> tuple[Any, ...]:
    preds, target = _labels(gen)
    target[::4] = -100
    return preds, target


def _scores(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.rand(16, generator=gen), torch.randint(0, 2, (16,), generator=gen)


def _logit_scores(gen: torch.Generator) -> tuple[Any, ...]:
    return torch.randn(16, generator=gen), torch.randint(0, 2, (16,), generator=gen).bool()


CASES: dict[str, tuple[Callable[[], tt.Metric], Inputs]] = {
    "sum": (tt.SumMetric, _values),
    "sum_int64": (lambda: tt.SumMetric(dtype=torch.int64), lambda gen: _labels(gen)[:1]),
    "counter_strict": (lambda: tt.SumMetric(kind="counter", nan_policy="error"), _positive),
    "sum_ignore_nan": (lambda: tt.SumMetric(nan_policy="ignore"), _with_nan),
    "weighted_mean": (tt.WeightedMeanMetric, _weighted),
    "weighted_mean_scalar_weight": (tt.WeightedMeanMetric, _scalar_weighted),
    "weighted_mean_ignore_nan": (lambda: tt.WeightedMeanMetric(nan_policy="ignore"), _weighted),
    "max": (tt.MaxMetric, _values),
    "min": (tt.MinMetric, _values),
    "min_ignore_nan": (lambda: tt.MinMetric(nan_policy="ignore"), _with_nan),
    "per_rank": (lambda: tt.PerRankMetric(4, 2), _values),
    "per_rank_ignore_nan": (lambda: tt.PerRankMetric(2, 0, nan_policy="ignore"), _with_nan),
    "accuracy_top2": (lambda: tt.AccuracyMetric(top_k=2, num_classes=5), _logits),
    "accuracy_labels": (lambda: tt.AccuracyMetric(num_classes=5, ignore_index=-100), _ignored_labels),
    "confusion_matrix": (lambda: tt.ConfusionMatrixMetric(5), _logits),
    "binary_auroc": (lambda: tt.BinaryAUROCMetric(num_bins=32), _scores),
    "binary_auroc_logits": (lambda: tt.BinaryAUROCMetric(num_bins=32, from_logits=True), _logit_scores),
    "histogram": (lambda: tt.HistogramMetric([0.1, 0.5, 1.0, 2.0]), _positive),
    "histogram_strict": (lambda: tt.HistogramMetric([0.0, 1.0], nan_policy="error"), _values),
}

STEPS = 4


def _state(metric: tt.Metric) -> dict[str, torch.Tensor]:
    return {attr: acc.local.clone() for attr, acc in metric.accumulators.items()}


def _run_compiled(name: str, backend: str) -> tuple[dict, dict]:
    """States after STEPS eager and compiled updates; a recompile after the first step raises."""
    make, inputs = CASES[name]
    torch.compiler.reset()
    eager, compiled = make(), make()
    update = torch.compile(compiled.update, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    for step in range(STEPS):
        args = inputs(gen)
        eager.update(*args)
        if step == 0:
            update(*args)
            continue
        with torch.compiler.set_stance("fail_on_recompile"):  # new values must not force a recompile
            update(*args)
    return _state(eager), _state(compiled)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_update_matches_eager_without_graph_breaks(name: str) -> None:
    eager, compiled = _run_compiled(name, "aot_eager")  # fullgraph=True raises on any graph break
    assert eager.keys() == compiled.keys()
    for attr in eager:
        torch.testing.assert_close(compiled[attr], eager[attr], rtol=0, atol=0, equal_nan=True, msg=attr)
        initial = CASES[name][0]().accumulators[attr].initial
        assert not torch.equal(compiled[attr], initial), f"{name}.{attr} was never updated"


@pytest.mark.parametrize("name", ["weighted_mean", "histogram", "confusion_matrix"])
def test_inductor_compiled_update_matches_eager(name: str) -> None:
    eager, compiled = _run_compiled(name, "inductor")
    for attr in eager:
        torch.testing.assert_close(compiled[attr], eager[attr], equal_nan=True, msg=attr)


def test_compiled_training_step_keeps_updating_the_same_state() -> None:
    """A compiled step updating several metrics: local tensors keep their storage, values add up."""
    torch.compiler.reset()
    metrics = {"loss": tt.WeightedMeanMetric(), "tokens": tt.SumMetric(kind="counter"), "max": tt.MaxMetric()}
    storage = {name: acc.local.data_ptr() for name, acc in named_accumulators(metrics).items()}

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        loss = (x * x).mean()
        metrics["loss"].update(loss, n)
        metrics["tokens"].update(n)
        metrics["max"].update(x.abs().max())
        return loss

    expected_loss_sum, expected_tokens, expected_max = 0.0, 0.0, float("-inf")
    for i in range(5):
        x = torch.full((8,), float(i + 1))
        n = torch.tensor(float(10 * (i + 1)))
        step(x, n)
        expected_loss_sum += (i + 1) ** 2 * 10 * (i + 1)
        expected_tokens += 10 * (i + 1)
        expected_max = max(expected_max, i + 1)
    assert metrics["loss"].weighted_sum.local.item() == expected_loss_sum
    assert metrics["loss"].total_weight.local.item() == expected_tokens
    assert metrics["tokens"].total.local.item() == expected_tokens
    assert metrics["max"].extremum.local.item() == expected_max
    assert {name: acc.local.data_ptr() for name, acc in named_accumulators(metrics).items()} == storage


@pytest.mark.parametrize(
    ("options", "target", "counted"),
    [
        ({}, [1, 3, 2, -1], (2.0, 2.0)),
        ({"ignore_index": -100}, [1, -100, 2, 7], (2.0, 2.0)),
        ({"ignore_index": 1}, [1, 0, 2, 5], (2.0, 2.0)),  # target 1 is the argmax, and ignored
        ({"nan_policy": "ignore"}, [1, 0, 2, 0], (3.0, 3.0)),  # the NaN is its argmax: a hit, skipped
    ],
    ids=["labels out of range", "ignore_index no class", "ignore_index a class", "NaN logits ignored"],
)
def test_a_compiled_accuracy_masks_labels_as_a_device_does(
    options: dict[str, Any], target: list[int], counted: tuple[float, float]
) -> None:
    """Compiled, accuracy never reads its labels (as on a device): a label outside the classes or
    equal to `ignore_index` counts for nothing, nor does a sample whose logits are not all finite
    under nan_policy="ignore". Top-1 hits of logits skip the mask's `&` where no mask can drop one
    (device ops: tests/metric/test_metrics.py); these cases hold where it must stay."""
    torch.compiler.reset()
    logits = torch.tensor(
        [[0.1, 2.0, 0.3], [1.5, 0.2, 0.4], [0.3, 0.1, 0.9], [0.2, 0.8, 0.5]]
    )  # argmax 1 0 2 1
    if options.get("nan_policy") == "ignore":
        logits[3, 0] = float("nan")
    metric = tt.AccuracyMetric(**options)
    torch.compile(metric.update, fullgraph=True, backend="aot_eager")(logits, torch.tensor(target))
    assert (metric.correct.local.item(), metric.total.local.item()) == counted
