"""The built-ins against torchmetrics 1.9 (the `bench` extra) on the same data: every example of every
exported metric that has a torchmetrics peer (`PEERS`, which names each exported class), and for
the classification metrics tied logits, classes absent from a window, one process and sharded over
2 gloo ranks, through each metric's own `compute()` and through the batched window compute
(`sync_and_compute`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.metric.examples import EXAMPLES, METRIC_CLASSES, build, feed
from tests.metric.test_metrics import computed

torchmetrics = pytest.importorskip("torchmetrics")
classification = pytest.importorskip("torchmetrics.classification")
aggregation = pytest.importorskip("torchmetrics.aggregation")


@dataclass(frozen=True)
class Peer:
    """How to build the torchmetrics metric that computes what one of ours does, and feed it."""

    make: Callable[[Any, Any], Any]
    """(our metric, its example) -> the torchmetrics metric, or None for a configuration it lacks."""
    inputs: Callable[[Any, tuple], tuple] = lambda metric, args: args
    """(our metric, the arguments of one of our updates) -> the peer's update arguments."""


def _nan_strategy(metric: tt.Metric) -> str:
    """The examples hold NaN only under nan_policy="ignore" ("disable", the closest to "propagate",
    drops MeanMetric's weights in torchmetrics 1.9)."""
    return "ignore" if metric.nan_policy == "ignore" else "error"


def _flat_classes(metric: tt.Metric, args: tuple) -> tuple:
    """Logits `[..., C]` as `[N, C]` and labels as `[N]`: torchmetrics puts the class dim second."""
    preds, target = args
    if preds.is_floating_point():
        return preds.reshape(-1, preds.shape[-1]), target.reshape(-1)
    return preds.reshape(-1), target.reshape(-1)


def _num_classes(metric: tt.Metric, example: tt.metric.MetricExample) -> int:
    preds = example.updates[0][0]
    return metric.num_classes or preds.shape[-1]  # type: ignore[attr-defined]


def _scores(metric: tt.Metric, example: tt.metric.MetricExample) -> Any:
    """Precision, recall and F1, per class and macro-averaged: what ConfusionMatrixMetric gives."""
    options = {"num_classes": metric.num_classes, "ignore_index": metric.ignore_index}  # type: ignore[attr-defined]
    kinds = {
        "precision": classification.MulticlassPrecision,
        "recall": classification.MulticlassRecall,
        "f1": classification.MulticlassF1Score,
    }
    per_class = {name: kind(average="none", **options) for name, kind in kinds.items()}
    macro = {f"macro_{name}": kind(average="macro", **options) for name, kind in kinds.items()}
    return torchmetrics.MetricCollection({**per_class, **macro})


PEERS: dict[type[tt.Metric], Peer | None] = {
    tt.SumMetric: Peer(lambda metric, _: aggregation.SumMetric(nan_strategy=_nan_strategy(metric))),
    tt.WeightedMeanMetric: Peer(lambda metric, _: aggregation.MeanMetric(nan_strategy=_nan_strategy(metric))),
    tt.MaxMetric: Peer(lambda metric, _: aggregation.MaxMetric(nan_strategy=_nan_strategy(metric))),
    tt.MinMetric: Peer(lambda metric, _: aggregation.MinMetric(nan_strategy=_nan_strategy(metric))),
    tt.AccuracyMetric: Peer(
        lambda metric, example: (
            None
            if metric.nan_policy == "ignore"  # torchmetrics counts a NaN logit's sample
            else classification.MulticlassAccuracy(
                _num_classes(metric, example),
                top_k=metric.top_k,
                average="micro",
                ignore_index=metric.ignore_index,
            )
        ),
        _flat_classes,
    ),
    tt.ConfusionMatrixMetric: Peer(_scores, _flat_classes),
    tt.BinaryAUROCMetric: Peer(
        lambda metric, _: classification.BinaryAUROC(),  # exact: the examples' scores fall in distinct bins
        lambda metric, args: (args[0].sigmoid() if metric.from_logits else args[0], args[1].long()),
    ),
    tt.PerRankMetric: None,  # no peer: a value per rank
    tt.HistogramMetric: None,  # no peer: torchmetrics has no fixed-bucket histogram
}
"""Every exported metric class: its torchmetrics peer, or None where torchmetrics has none."""


def test_every_exported_metric_names_its_torchmetrics_peer_or_none() -> None:
    missing = [cls.__name__ for cls in METRIC_CLASSES if cls not in PEERS]
    assert missing == [], f"add {missing} to PEERS: a Peer building the torchmetrics metric, or None"


def _tensors(args: tuple) -> tuple:
    return tuple(torch.as_tensor(arg) for arg in args)


@pytest.mark.parametrize(("cls", "example"), [case for case in EXAMPLES if PEERS.get(case.values[0])])
def test_every_example_equals_its_torchmetrics_peer(
    cls: type[tt.Metric], example: tt.metric.MetricExample
) -> None:
    peer = PEERS[cls]
    assert peer is not None
    metric = feed(build(cls, example), example)
    reference = peer.make(metric, example)
    if reference is None:
        pytest.skip(f"{cls.__name__} ({example.form}): torchmetrics has no such configuration")
    for args in example.updates:
        tensors = _tensors(args)
        if all(tensor.numel() for tensor in tensors):  # torchmetrics refuses an empty batch; ours skips it
            reference.update(*peer.inputs(metric, tensors))
    expected = reference.compute()
    torch.testing.assert_close(
        computed(metric), expected, check_dtype=False, rtol=1e-6, atol=1e-9, equal_nan=True
    )


NUM_CLASSES = 5


def _tied_logits(rows: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits rounded to one decimal: many rows have several classes tied for the top."""
    generator = torch.Generator().manual_seed(13)
    logits = (torch.rand(rows, NUM_CLASSES, generator=generator) * 0.4).round(decimals=1)
    return logits, torch.randint(0, NUM_CLASSES, (rows,), generator=generator)


def _absent_classes() -> tuple[torch.Tensor, torch.Tensor]:
    """Labels in which classes 2 and 4 never occur, and class 3 is predicted but never the target."""
    generator = torch.Generator().manual_seed(14)
    target = torch.tensor([0, 1])[torch.randint(0, 2, (200,), generator=generator)]
    preds = torch.where(torch.rand(200, generator=generator) < 0.7, target, torch.tensor([0, 1, 3])[target])
    return preds, target


def _reference(preds: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    scores = {
        "accuracy": classification.MulticlassAccuracy(NUM_CLASSES, average="micro"),
        "macro_precision": classification.MulticlassPrecision(NUM_CLASSES, average="macro"),
        "macro_recall": classification.MulticlassRecall(NUM_CLASSES, average="macro"),
        "macro_f1": classification.MulticlassF1Score(NUM_CLASSES, average="macro"),
    }
    return {name: metric(preds, target).item() for name, metric in scores.items()}


def _ours(results: dict[str, object]) -> dict[str, float]:
    matrix = results["confusion"]
    return {
        "accuracy": float(results["accuracy"]),
        "macro_precision": float(matrix["macro_precision"]),  # type: ignore[index]
        "macro_recall": float(matrix["macro_recall"]),  # type: ignore[index]
        "macro_f1": float(matrix["macro_f1"]),  # type: ignore[index]
    }


def _fed(preds: torch.Tensor, target: torch.Tensor) -> dict[str, tt.Metric]:
    metrics = {"accuracy": tt.AccuracyMetric(), "confusion": tt.ConfusionMatrixMetric(NUM_CLASSES)}
    for chunk in range(0, len(target), 64):
        for metric in metrics.values():
            metric.update(preds[chunk : chunk + 64], target[chunk : chunk + 64])
    return metrics


def _both_paths(metrics: dict[str, tt.Metric]) -> list[dict[str, float]]:
    own = {name: computed(metric) for name, metric in metrics.items()}
    return [_ours(own), _ours(tt.sync_and_compute(metrics))]


@pytest.mark.parametrize("data", [_tied_logits, _absent_classes], ids=["tied logits", "absent classes"])
def test_accuracy_and_macro_averages_equal_torchmetrics(data) -> None:
    preds, target = data()
    expected = _reference(preds, target)
    for ours in _both_paths(_fed(preds, target)):
        assert ours == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_a_tied_top_logit_is_the_lowest_class_for_accuracy_and_confusion_matrix_alike() -> None:
    logits, target = torch.full((1, NUM_CLASSES), 2.0), torch.tensor([2])
    metrics = _fed(logits, target)
    own = {name: computed(metric) for name, metric in metrics.items()}
    assert own["accuracy"].item() == 0.0, "argmax: class 0 wins the tie"
    assert own["confusion"]["recall"][2].item() == 0.0
    assert metrics["confusion"].matrix.value[2, 0].item() == 1.0


@pytest.mark.parametrize(
    ("logits", "target", "hit"),
    [
        ([2.0, 2.0, 2.0, 2.0, 2.0], 1, True),  # classes 0 and 1 take the two places
        ([2.0, 2.0, 2.0, 2.0, 2.0], 2, False),
        ([1.0, 3.0, 3.0, 3.0, 0.0], 2, True),  # 3.0 at 1, 2, 3: the lower two are in
        ([1.0, 3.0, 3.0, 3.0, 0.0], 3, False),
        ([float("nan"), 3.0, 0.0, 0.0, 0.0], 1, True),  # NaN first, then 3.0
        ([float("nan"), float("nan"), 5.0, 0.0, 0.0], 2, False),
        ([float("nan"), 0.0, float("nan"), 0.0, 0.0], 2, True),
    ],
)
def test_top_k_ties_go_to_the_lower_class_index(logits: list[float], target: int, hit: bool) -> None:
    metric = tt.AccuracyMetric(top_k=2)
    metric.update(torch.tensor([logits]), torch.tensor([target]))
    assert computed(metric).item() == float(hit)


def _sharded(rank: int, world_size: int, data_name: str) -> dict[str, float]:
    preds, target = {"tied": _tied_logits, "absent": _absent_classes}[data_name]()
    metrics = _fed(preds[rank::world_size], target[rank::world_size])
    return _ours(tt.sync_and_compute(metrics))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data_name", ["tied", "absent"])
def test_sharded_over_two_ranks_equals_torchmetrics_on_all_the_data(data_name: str) -> None:
    preds, target = {"tied": _tied_logits, "absent": _absent_classes}[data_name]()
    expected = _reference(preds, target)
    for ours in run_ranks(_sharded, 2, data_name):
        assert ours == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert np.isfinite(list(expected.values())).all()
