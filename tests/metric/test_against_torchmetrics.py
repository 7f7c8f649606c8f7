"""The classification built-ins against torchmetrics 1.9 (the `bench` extra) on the same data: tied
logits, classes absent from a window, one process and sharded over 2 gloo ranks, through each
metric's own `compute()` and through the batched window compute (`sync_and_compute`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.metric.test_metrics import computed

classification = pytest.importorskip("torchmetrics.classification")

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
