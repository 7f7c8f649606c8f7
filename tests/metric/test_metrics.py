"""Built-in metrics against values computed independently with numpy / plain Python."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.metric.examples import EXAMPLES, PATHS, build, feed, on_path
from tests.ops import OpCounter
from tests.trees import pytree


def computed(metric: tt.Metric):
    metric.sync()  # no process group: a local copy into `value`
    return metric.compute()


def states(metric: tt.Metric) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in metric.state_dict().items()}


def assert_same_state(before: dict[str, torch.Tensor], metric: tt.Metric) -> None:
    after = metric.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


# -- aggregations -----------------------------------------------------------------------------


def test_sum_of_tensors_numbers_and_numpy_scalars() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(4, 3)) for _ in range(3)]
    metric = tt.SumMetric()
    for batch in batches:
        metric.update(torch.from_numpy(batch))
    metric.update(2.5)
    metric.update(np.float32(0.25))
    metric.update(np.int64(3))
    expected = sum(float(b.sum()) for b in batches) + 2.5 + 0.25 + 3
    assert computed(metric).item() == pytest.approx(expected, rel=1e-12)


def test_counter_sums_and_rejects_negative_values() -> None:
    metric = tt.SumMetric(kind="counter")
    assert metric.kind is tt.metric.MetricKind.COUNTER
    metric.update(torch.tensor([3, 4]))
    before = states(metric)
    with pytest.raises(ValueError, match=r"SumMetric.*counter cannot decrease"):
        metric.update(torch.tensor([5, -1]))
    assert_same_state(before, metric)
    assert computed(metric).item() == 7


def test_sum_rejects_histogram_kind() -> None:
    with pytest.raises(ValueError, match="SumMetric: kind must be"):
        tt.SumMetric(kind="histogram")


def test_weighted_mean_matches_numpy_average() -> None:
    rng = np.random.default_rng(1)
    metric = tt.WeightedMeanMetric()
    values, weights = [], []
    for _ in range(4):  # per-element weights
        value, weight = rng.normal(size=7), rng.integers(0, 10, size=7).astype(float)
        metric.update(torch.from_numpy(value), torch.from_numpy(weight))
        values.append(value)
        weights.append(weight)
    for loss, tokens in [(2.5, 100), (1.25, 300)]:  # scalar loss and token count, as tensors and numbers
        metric.update(torch.tensor(loss), torch.tensor(tokens))
        metric.update(loss, tokens)
        values.append(np.array([loss, loss]))
        weights.append(np.array([tokens, tokens], dtype=float))
    metric.update(torch.tensor([1.0, 3.0]), 2.0)  # a scalar weight applies to every element
    values.append(np.array([1.0, 3.0]))
    weights.append(np.array([2.0, 2.0]))
    expected = np.average(np.concatenate(values), weights=np.concatenate(weights))
    assert computed(metric).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("number", [3000000001.0, 16777217.0, 2.123456789, 0.1])
@pytest.mark.parametrize(
    "form", [lambda x: x, lambda x: [x], lambda x: (x, 0.0)], ids=["float", "list", "tuple"]
)
def test_python_floats_enter_a_float64_state_exactly(number: float, form) -> None:
    """A Python float is a float64: it enters a float64 state with no float32 stop on the way."""
    total, mean, largest = tt.SumMetric(), tt.WeightedMeanMetric(), tt.MaxMetric()
    weight = tt.WeightedMeanMetric()
    histogram = tt.HistogramMetric([1.0])
    for metric in (total, mean, largest, histogram):
        metric.update(form(number))
    weight.update(torch.tensor(1.0, dtype=torch.float64), number)
    assert computed(total).item() == number
    assert computed(largest).item() == number
    assert computed(histogram)["sum"].item() == number
    assert mean.weighted_sum.local.item() == number
    assert weight.total_weight.local.item() == number


def test_weighted_mean_is_nan_without_weight() -> None:
    assert torch.isnan(computed(tt.WeightedMeanMetric()))


def test_compute_in_one_process_gives_the_local_value_without_sync() -> None:
    """Without a process group there is nothing to synchronize: compute() reads the local state."""
    mean, total, histogram = tt.WeightedMeanMetric(), tt.SumMetric(), tt.HistogramMetric([1.0])
    mean.update(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0]))
    total.update(torch.tensor([1.0, 3.0]))
    histogram.update(torch.tensor([0.5, 2.0, 3.0]))
    assert mean.compute().item() == 2.5
    assert total.compute().item() == 4.0
    assert histogram.compute()["counts"].tolist() == [1.0, 2.0]
    total.update(1.0)  # a later update shows at once, sync() or not
    assert total.compute().item() == 5.0


def test_weighted_mean_detaches_inputs_that_require_grad() -> None:
    metric = tt.WeightedMeanMetric()
    loss = torch.tensor(2.0, requires_grad=True) * 3
    metric.update(loss, 4)
    assert not metric.weighted_sum.local.requires_grad
    assert computed(metric).item() == 6.0


@pytest.mark.parametrize(
    ("cls", "reduce", "start"), [(tt.MaxMetric, max, -np.inf), (tt.MinMetric, min, np.inf)]
)
def test_extrema(cls: type, reduce, start: float) -> None:
    rng = np.random.default_rng(2)
    metric = cls()
    assert computed(metric).item() == start
    batches = [rng.normal(size=5) for _ in range(4)]
    for batch in batches:
        metric.update(torch.from_numpy(batch))
    metric.update(torch.empty(0))  # an empty batch changes nothing
    metric.update(0.5)
    expected = reduce(reduce(b) for b in [*batches, [0.5]])
    assert computed(metric).item() == expected


def test_per_rank_mean_fills_only_its_slot() -> None:
    metric = tt.PerRankMetric(world_size=3, rank=1)
    metric.update(torch.tensor([1.0, 2.0, 6.0]))
    metric.update(5.0)
    result = computed(metric)
    assert torch.isnan(result[0]) and torch.isnan(result[2])
    assert result[1].item() == pytest.approx(14.0 / 4)
    with pytest.raises(ValueError, match=r"PerRankMetric: rank must be in \[0, world_size\)"):
        tt.PerRankMetric(world_size=2, rank=2)


# -- classification -----------------------------------------------------------------------------


def _topk_accuracy(logits: np.ndarray, target: np.ndarray, k: int, ignore: int | None) -> float:
    hits = total = 0
    for row, label in zip(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), strict=True):
        if ignore is not None and label == ignore:
            continue
        top = sorted(range(len(row)), key=lambda c: -row[c])[:k]
        hits += int(label in top)
        total += 1
    return hits / total


@pytest.mark.parametrize(("top_k", "ignore_index"), [(1, None), (2, None), (3, -100), (1, 0)])
def test_accuracy_from_logits(top_k: int, ignore_index: int | None) -> None:
    rng = np.random.default_rng(3)
    metric = tt.AccuracyMetric(top_k=top_k, ignore_index=ignore_index)
    all_logits, all_targets = [], []
    for _ in range(3):
        logits = rng.permuted(np.tile(np.arange(5.0), (2, 6, 1)), axis=-1)  # distinct scores: no ties
        target = rng.integers(0, 5, size=(2, 6))
        if ignore_index is not None:
            target[0, :2] = ignore_index
        metric.update(torch.from_numpy(logits), torch.from_numpy(target))
        all_logits.append(logits)
        all_targets.append(target)
    expected = _topk_accuracy(np.concatenate(all_logits), np.concatenate(all_targets), top_k, ignore_index)
    assert computed(metric).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("options", "ands"),
    [({}, 0), ({"ignore_index": -100}, 1), ({"ignore_index": 0}, 2), ({"nan_policy": "ignore"}, 2)],
    ids=["plain", "ignore_index no class", "ignore_index a class", "NaN logits ignored"],
)
def test_accuracy_from_logits_on_a_device_masks_hits_only_where_a_mask_can_drop_one(
    options: dict[str, Any], ands: int
) -> None:
    """On a device (meta: no data, the ops a GPU launches) out-of-range labels are masked, not read.
    A top-1 hit is a label equal to a class index, which only an ignore_index that is a class or the
    NaN mask can drop: otherwise the hits are summed without the mask's `&` (one launch fewer; the
    other `&` joins the ignore_index or NaN mask to the range mask). The counts these give:
    tests/collect/test_compile.py, which masks on the CPU as a device does."""
    metric = tt.AccuracyMetric(**options).to("meta")
    logits, target = torch.zeros(8, 5, device="meta"), torch.zeros(8, dtype=torch.int64, device="meta")
    with OpCounter() as counter:
        metric.update(logits, target)
    assert counter.ops["aten.bitwise_and.Tensor"] == ands, counter.ops
    assert counter.ops["aten.argmax.default"] == 1 and counter.ops["aten.sum.default"] == 2, counter.ops


def test_accuracy_from_labels() -> None:
    metric = tt.AccuracyMetric(ignore_index=-1)
    metric.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 2, -1]))
    metric.update(np.array([3]), np.array([3]))
    assert computed(metric).item() == pytest.approx(3 / 4)


def _confusion_reference(preds: list[int], target: list[int], num_classes: int) -> dict[str, np.ndarray]:
    matrix = np.zeros((num_classes, num_classes))
    for p, t in zip(preds, target, strict=True):
        matrix[t, p] += 1
    precision, recall, f1 = [], [], []
    for c in range(num_classes):
        tp, predicted, actual = matrix[c, c], matrix[:, c].sum(), matrix[c, :].sum()
        precision.append(tp / predicted if predicted else 0.0)
        recall.append(tp / actual if actual else 0.0)
        pr = precision[-1] + recall[-1]
        f1.append(2 * precision[-1] * recall[-1] / pr if pr else 0.0)
    return {
        "matrix": matrix,
        "precision": np.array(precision),
        "recall": np.array(recall),
        "f1": np.array(f1),
    }


def test_confusion_matrix_precision_recall_f1() -> None:
    rng = np.random.default_rng(4)
    num_classes = 4
    metric = tt.ConfusionMatrixMetric(num_classes, ignore_index=-100)
    preds, target = [], []
    for _ in range(3):  # from logits
        logits = rng.normal(size=(10, num_classes))
        labels = rng.integers(0, 3, size=10)  # class 3 never occurs: its recall and F1 are 0
        labels[:2] = -100
        metric.update(torch.from_numpy(logits), torch.from_numpy(labels))
        keep = labels != -100
        preds += list(logits.argmax(-1)[keep])
        target += list(labels[keep])
    metric.update(torch.tensor([1, 2]), torch.tensor([1, 0]))  # from labels
    preds += [1, 2]
    target += [1, 0]
    reference = _confusion_reference(preds, target, num_classes)
    result = computed(metric)
    np.testing.assert_array_equal(metric.matrix.value.numpy(), reference["matrix"])
    occurs = (reference["matrix"].sum(axis=0) + reference["matrix"].sum(axis=1)) > 0
    for key in ("precision", "recall", "f1"):
        np.testing.assert_allclose(result[key].numpy(), reference[key], rtol=1e-12)
        macro = reference[key][occurs].mean()  # over the classes in targets or predictions
        assert result[f"macro_{key}"].item() == pytest.approx(macro, rel=1e-12)


def _quantized_auroc(scores: np.ndarray, labels: np.ndarray, num_bins: int) -> float:
    bins = np.minimum(np.floor(scores * num_bins), num_bins - 1)
    positives, negatives = bins[labels == 1], bins[labels == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize("num_bins", [2, 7, 64])
def test_binary_auroc_equals_exact_pairwise_auroc_of_binned_scores(num_bins: int) -> None:
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, size=200)
    # Scores strictly inside bins (bin + 0.1..0.9) so float rounding cannot move them across an edge.
    scores = (rng.integers(0, num_bins, size=200) + rng.uniform(0.1, 0.9, size=200)) / num_bins
    scores = np.where(labels == 1, np.minimum(scores + 0.2, 0.999), scores)
    scores[:3] = [0.0, 1.0, 1.0]  # both ends of the range
    metric = tt.BinaryAUROCMetric(num_bins=num_bins)
    for chunk in np.array_split(np.arange(200), 4):
        metric.update(torch.from_numpy(scores[chunk]), torch.from_numpy(labels[chunk]))
    assert computed(metric).item() == pytest.approx(_quantized_auroc(scores, labels, num_bins), abs=1e-12)


def test_binary_auroc_from_logits_and_one_class_only() -> None:
    probabilities = np.array([0.1, 0.4, 0.35, 0.8])
    labels = np.array([0, 0, 1, 1])
    metric = tt.BinaryAUROCMetric(num_bins=1000, from_logits=True)
    metric.update(torch.logit(torch.from_numpy(probabilities)), torch.from_numpy(labels).bool())
    assert computed(metric).item() == pytest.approx(0.75)
    only_negatives = tt.BinaryAUROCMetric()
    only_negatives.update(torch.tensor([0.2, 0.3]), torch.tensor([0, 0]))
    assert torch.isnan(computed(only_negatives))


# -- histogram ----------------------------------------------------------------------------------


def test_histogram_edges_and_out_of_range_values() -> None:
    bins = [0.1, 0.5, 1.0, 2.0]
    values = [-5.0, 0.0, 0.1, 0.10001, 0.5, 0.7, 1.0, 2.0, 2.5, 100.0]
    metric = tt.HistogramMetric(bins=bins)
    metric.update(torch.tensor(values[:4]))
    metric.update(torch.tensor(values[4:], dtype=torch.float64))
    result = computed(metric)
    # Prometheus `le` buckets: (-inf, 0.1], (0.1, 0.5], (0.5, 1], (1, 2], (2, +inf)
    expected = [
        sum(1 for v in values if lo < v <= hi) for lo, hi in itertools.pairwise([-np.inf, *bins, np.inf])
    ]
    assert expected == [3, 2, 2, 1, 2]
    assert result["counts"].tolist() == expected
    assert result["bounds"].tolist() == bins
    assert result["count"].item() == len(values)
    assert result["sum"].item() == pytest.approx(sum(np.float32(v) for v in values[:4]) + sum(values[4:]))


@pytest.mark.parametrize("bins", [[], [1.0, 1.0], [2.0, 1.0], [0.0, float("inf")]])
def test_histogram_rejects_bad_bins(bins: list[float]) -> None:
    with pytest.raises(ValueError, match="HistogramMetric: bins must be"):
        tt.HistogramMetric(bins=bins)


# -- nan_policy -----------------------------------------------------------------------------------


NAN_BATCH = [1.0, float("nan"), 3.0, float("inf")]


def test_nan_policy_propagate_is_the_default() -> None:
    metrics = [tt.SumMetric(), tt.WeightedMeanMetric(), tt.MaxMetric(), tt.MinMetric()]
    for metric in metrics:
        assert metric.nan_policy == "propagate"
        metric.update(torch.tensor(NAN_BATCH))
        assert torch.isnan(computed(metric)), type(metric).__name__
    histogram = tt.HistogramMetric(bins=[1.0, 2.0])
    histogram.update(torch.tensor(NAN_BATCH))
    assert torch.isnan(computed(histogram)["sum"])


def test_nan_policy_ignore_skips_non_finite_entries() -> None:
    finite = [1.0, 3.0]
    expectations = {
        tt.SumMetric: 4.0,
        tt.WeightedMeanMetric: 2.0,
        tt.MaxMetric: 3.0,
        tt.MinMetric: 1.0,
    }
    for cls, expected in expectations.items():
        metric = cls(nan_policy="ignore")
        metric.update(torch.tensor(NAN_BATCH))
        assert computed(metric).item() == expected, cls.__name__
    weighted = tt.WeightedMeanMetric(nan_policy="ignore")
    weighted.update(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1.0, float("nan"), 1.0]))
    assert computed(weighted).item() == 2.0
    histogram = tt.HistogramMetric(bins=[2.0], nan_policy="ignore")
    histogram.update(torch.tensor(NAN_BATCH))
    assert computed(histogram)["counts"].tolist() == [1, 1]
    assert computed(histogram)["sum"].item() == sum(finite)
    per_rank = tt.PerRankMetric(1, 0, nan_policy="ignore")
    per_rank.update(torch.tensor(NAN_BATCH))
    assert computed(per_rank).tolist() == [2.0]


@pytest.mark.parametrize(
    ("make", "update"),
    [
        (lambda: tt.SumMetric(nan_policy="error"), lambda m: m.update(torch.tensor(NAN_BATCH))),
        (lambda: tt.MaxMetric(nan_policy="error"), lambda m: m.update(torch.tensor(NAN_BATCH))),
        (lambda: tt.MinMetric(nan_policy="error"), lambda m: m.update(float("nan"))),
        (lambda: tt.WeightedMeanMetric(nan_policy="error"), lambda m: m.update(1.0, float("inf"))),
        (lambda: tt.HistogramMetric([1.0], nan_policy="error"), lambda m: m.update(torch.tensor(NAN_BATCH))),
        (lambda: tt.PerRankMetric(2, 0, nan_policy="error"), lambda m: m.update(torch.tensor(NAN_BATCH))),
        (
            lambda: tt.BinaryAUROCMetric(nan_policy="error"),
            lambda m: m.update(torch.tensor([0.5, float("nan")]), torch.tensor([0, 1])),
        ),
    ],
)
def test_nan_policy_error_raises_and_keeps_state(make, update) -> None:
    metric = make()
    metric.update(
        torch.tensor([0.5]), *([torch.tensor([1])] if isinstance(metric, tt.BinaryAUROCMetric) else [])
    )
    before = states(metric)
    with pytest.raises(ValueError, match=rf"{type(metric).__name__}.*NaN or Inf and nan_policy='error'"):
        update(metric)
    assert_same_state(before, metric)


def test_unknown_nan_policy() -> None:
    with pytest.raises(ValueError, match="SumMetric: nan_policy must be one of"):
        tt.SumMetric(nan_policy="skip")  # type: ignore[arg-type]


# -- bad input: a clear error naming the metric, state untouched ---------------------------------------

BAD_INPUTS = [
    (
        "weights shape",
        lambda: tt.WeightedMeanMetric(name="loss"),
        ((torch.ones(3), torch.ones(2)),),
        ValueError,
        "WeightedMeanMetric 'loss': weight has shape",
    ),
    (
        "negative weight",
        tt.WeightedMeanMetric,
        ((torch.ones(3), torch.tensor([1.0, -1.0, 1.0])),),
        ValueError,
        "WeightedMeanMetric: weight must be non-negative",
    ),
    (
        "negative scalar weight",
        tt.WeightedMeanMetric,
        ((torch.tensor(2.0), -3),),
        ValueError,
        "weight must be non-negative",
    ),
    (
        "non-number value",
        tt.SumMetric,
        (("a lot",),),
        TypeError,
        "SumMetric: value must be a tensor or a number",
    ),
    (
        "object value",
        tt.MaxMetric,
        ((object(),),),
        TypeError,
        "MaxMetric: value must be a tensor or a number",
    ),
    (
        "labels where logits expected",
        lambda: tt.AccuracyMetric(top_k=2),
        ((torch.tensor([0, 1]), torch.tensor([0, 1])),),
        ValueError,
        "AccuracyMetric: top_k=2 needs logits",
    ),
    (
        "top_k above classes",
        lambda: tt.AccuracyMetric(top_k=4),
        ((torch.zeros(2, 3), torch.tensor([0, 1])),),
        ValueError,
        "top_k=4 exceeds the 3 classes",
    ),
    (
        "float targets",
        tt.AccuracyMetric,
        ((torch.zeros(2, 3), torch.tensor([0.0, 1.0])),),
        TypeError,
        "AccuracyMetric: target must hold integer class labels",
    ),
    (
        "logits shape",
        tt.AccuracyMetric,
        ((torch.zeros(2, 3), torch.tensor([0, 1, 2])),),
        ValueError,
        "AccuracyMetric: logits have shape",
    ),
    (
        "label out of range",
        tt.AccuracyMetric,
        ((torch.zeros(2, 3), torch.tensor([0, 3])),),
        ValueError,
        r"AccuracyMetric: target has labels outside \[0, 3\)",
    ),
    (
        "wrong class count",
        lambda: tt.AccuracyMetric(num_classes=4),
        ((torch.zeros(2, 3), torch.tensor([0, 1])),),
        ValueError,
        "logits have 3 classes, expected 4",
    ),
    (
        "confusion target range",
        lambda: tt.ConfusionMatrixMetric(3),
        ((torch.tensor([0, 1]), torch.tensor([0, 5])),),
        ValueError,
        "ConfusionMatrixMetric: target has labels",
    ),
    (
        "confusion pred range",
        lambda: tt.ConfusionMatrixMetric(3),
        ((torch.tensor([0, 7]), torch.tensor([0, 1])),),
        ValueError,
        "ConfusionMatrixMetric: predictions have",
    ),
    (
        "confusion float target",
        lambda: tt.ConfusionMatrixMetric(3),
        ((torch.zeros(2, 3), torch.tensor([0.0, 1.0])),),
        TypeError,
        "ConfusionMatrixMetric: target must hold",
    ),
    (
        "auroc integer scores",
        tt.BinaryAUROCMetric,
        ((torch.tensor([0, 1]), torch.tensor([0, 1])),),
        TypeError,
        "BinaryAUROCMetric: preds must be floating point",
    ),
    (
        "auroc float target",
        tt.BinaryAUROCMetric,
        ((torch.tensor([0.2, 0.7]), torch.tensor([0.0, 1.0])),),
        TypeError,
        "BinaryAUROCMetric: target must be 0/1",
    ),
    (
        "auroc target values",
        tt.BinaryAUROCMetric,
        ((torch.tensor([0.2, 0.7]), torch.tensor([0, 2])),),
        ValueError,
        "BinaryAUROCMetric: target must be 0 or 1",
    ),
    (
        "auroc shapes",
        tt.BinaryAUROCMetric,
        ((torch.tensor([0.2, 0.7]), torch.tensor([0, 1, 1])),),
        ValueError,
        "BinaryAUROCMetric: preds have shape",
    ),
    (
        "tensor on another device",
        tt.SumMetric,
        ((torch.ones(2, device="meta"),),),
        ValueError,
        "SumMetric: value is on meta, but the metric lives on cpu",
    ),
]


def _good_input(metric: tt.Metric) -> tuple:
    if isinstance(metric, tt.WeightedMeanMetric):
        return torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])
    if isinstance(metric, tt.AccuracyMetric):
        return torch.eye(metric.num_classes or max(3, metric.top_k))[:3], torch.tensor([0, 1, 2])
    if isinstance(metric, tt.ConfusionMatrixMetric):
        return torch.tensor([0, 2]), torch.tensor([0, 1])
    if isinstance(metric, tt.BinaryAUROCMetric):
        return torch.tensor([0.3, 0.6]), torch.tensor([0, 1])
    return (torch.tensor([4.0]),)


@pytest.mark.parametrize(
    ("make", "args", "error", "message"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_raises_naming_the_metric_and_keeps_state(make, args, error, message) -> None:
    metric = make()
    good = _good_input(metric)
    metric.update(*good)
    before = states(metric)
    with pytest.raises(error, match=message):
        metric.update(*args[0])
    assert_same_state(before, metric)


def test_cpu_scalar_tensors_are_accepted_on_any_device() -> None:
    metric = tt.WeightedMeanMetric().to("meta")
    metric.update(torch.tensor(1.0), torch.tensor(2))  # 0-d CPU tensors (e.g. from .sum() on host) move over
    assert metric.weighted_sum.local.device.type == "meta"


@pytest.mark.parametrize(
    ("make", "args"),
    [
        (tt.SumMetric, (torch.empty(0),)),
        (tt.WeightedMeanMetric, (torch.empty(0), torch.empty(0))),
        (tt.MaxMetric, (torch.empty(0),)),
        (lambda: tt.HistogramMetric([1.0]), (torch.empty(0),)),
        (tt.AccuracyMetric, (torch.empty(0, 3), torch.empty(0, dtype=torch.long))),
        (lambda: tt.ConfusionMatrixMetric(3), (torch.empty(0, 3), torch.empty(0, dtype=torch.long))),
        (tt.BinaryAUROCMetric, (torch.empty(0), torch.empty(0, dtype=torch.long))),
    ],
)
def test_empty_batches_change_nothing(make, args) -> None:
    metric = make()
    before = states(metric)
    metric.update(*args)
    assert_same_state(before, metric)


# -- state dicts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_state_dict_round_trip_is_exact(
    cls: type[tt.Metric], example: tt.metric.MetricExample, path: str
) -> None:
    """Every exported metric, fed each example it declares: `state_dict()` loaded into a fresh
    instance gives the same state, in place, and the same results (staged: what was staged is in it)."""
    source = feed(on_path(build(cls, example), path), example, times=2)
    target = on_path(build(cls, example), path)
    saved = source.state_dict()
    pointers = {attr: acc.local.data_ptr() for attr, acc in target.accumulators.items()}
    target.load_state_dict(saved)
    assert_same_state(saved, target)
    assert {attr: acc.local.data_ptr() for attr, acc in target.accumulators.items()} == pointers
    torch.testing.assert_close(computed(source), computed(target), rtol=0, atol=0, equal_nan=True)


def test_load_state_dict_rejects_missing_extra_and_misshaped_keys_without_change() -> None:
    metric = tt.HistogramMetric([0.5, 1.0])
    metric.update(torch.tensor([0.2, 0.7, 1.5]))
    before = states(metric)
    good = metric.state_dict()
    with pytest.raises(
        ValueError, match=r"HistogramMetric: load_state_dict keys do not match \(missing: \['sum'\]"
    ):
        metric.load_state_dict({k: v for k, v in good.items() if k != "sum"})
    with pytest.raises(ValueError, match=r"unexpected: \['extra'\]"):
        metric.load_state_dict({**good, "extra": torch.zeros(())})
    # The mis-shaped entry comes last: nothing before it may have been written either.
    with pytest.raises(ValueError, match=r"entry 'count' has shape \(2,\), expected \(\)"):
        metric.load_state_dict({**{k: v * 0 for k, v in good.items()}, "count": torch.zeros(2)})
    with pytest.raises(TypeError, match="HistogramMetric: saved state must be a tensor"):
        metric.load_state_dict({**{k: v * 0 for k, v in good.items()}, "count": "nope"})
    assert_same_state(before, metric)


def test_per_rank_update_total_adds_a_presummed_total_to_this_ranks_slot() -> None:
    metric = tt.PerRankMetric(3, 1)
    metric.update_total(torch.tensor(6.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    metric.update(torch.tensor([2.0]))
    metric.sync()
    means = metric.compute().tolist()
    assert means[1] == 2.0  # (6 + 2) / (3 + 1)
    assert np.isnan(means[0]) and np.isnan(means[2])


# -- one prologue -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_every_builtin_update_runs_the_one_prologue_once(
    cls: type[tt.Metric], example: tt.metric.MetricExample, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread check, the input conversion and nan_policy live in `UpdateInputs` only: each
    built-in `update()` runs exactly one prologue, `_begin_update` (a second input goes through
    `_input`) or, for the common case it accepts, `_ready_scalars`."""
    from torchtelemetry.metric._inputs import UpdateInputs

    calls: list[str] = []
    prologue, ready = UpdateInputs._begin_update, UpdateInputs._ready_scalars

    def counted(self: tt.Metric, *args, **kwargs):
        calls.append(type(self).__name__)
        return prologue(self, *args, **kwargs)

    def counted_ready(self: tt.Metric, *args, **kwargs):
        accepted = ready(self, *args, **kwargs)
        if accepted:
            calls.append(type(self).__name__)
        return accepted

    monkeypatch.setattr(UpdateInputs, "_begin_update", counted)
    monkeypatch.setattr(UpdateInputs, "_ready_scalars", counted_ready)
    feed(build(cls, example), example)
    assert calls == [cls.__name__] * len(example.updates)


def test_a_ready_tensor_costs_the_prologue_no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0-d loss and token count already on the metric's device, of real dtypes, outside autograd,
    go into the weighted mean's two kernels as they are: one expression (`_ready_scalars`) checks
    them, with no conversion and no per-input prologue (bench/bench_update.py measures what this
    saves; a count, not a time)."""
    import sys

    metric = tt.WeightedMeanMetric()
    loss, tokens = torch.tensor(2.5), torch.tensor(512)
    metric.update(loss, tokens)
    entered: list[str] = []

    def profile(frame, event: str, arg) -> None:
        if event == "call":
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        metric.update(loss, tokens)
    finally:
        sys.setprofile(None)
    assert "_as_tensor" not in entered and "_converted" not in entered
    assert entered.count("_ready_scalars") == 1
    assert "_begin_update" not in entered and "_input" not in entered
    assert metric.weighted_sum.local.item() == 2 * 2.5 * 512


@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_every_builtin_compute_is_its_batched_rule_with_one_instance(
    cls: type[tt.Metric], example: tt.metric.MetricExample
) -> None:
    """Each built-in's formula exists once: `compute()` runs the rule a window batches K instances
    with, and gives new tensors (a later update does not change a result already computed)."""
    from torchtelemetry.metric import batched_rule

    metric = feed(build(cls, example), example)
    assert cls.compute is tt.Metric.compute
    assert batched_rule(metric) is cls.batched is not None
    before = computed(metric)
    kept = pytree.tree_map(torch.clone, before)
    feed(metric, example)
    torch.testing.assert_close(before, kept, rtol=0, atol=0, equal_nan=True)


def test_a_metric_that_names_no_label_uses_the_exporters_default() -> None:
    """One default label for the entries of a 1-D result: what a custom metric's entries are exported
    under is what exporters call a labelled value without a name ("label", once "index")."""
    from torchtelemetry.export._hub import _inferred_descriptor
    from torchtelemetry.metric import DEFAULT_LABEL_NAME
    from torchtelemetry.report import describe_metrics, flatten_results

    class Spread(tt.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.values = tt.MetricAccumulator(torch.zeros(2))

        def update(self, value: torch.Tensor) -> None:
            self.values.update(value)

        def compute(self) -> torch.Tensor:
            return self.values.value.clone()

    (descriptor,) = describe_metrics({"spread": Spread()})
    assert descriptor.label_name == DEFAULT_LABEL_NAME == "label"
    assert _inferred_descriptor("x", {"0": 1.0}).label_name == descriptor.label_name
    assert flatten_results([("spread", Spread())], [[1.0, 2.0]]) == {"spread": {"0": 1.0, "1": 2.0}}


def _weighted_mean_outcome(
    value: torch.Tensor, weight: torch.Tensor, *, common_case: bool, device: str = "cpu"
) -> tuple:
    """What `WeightedMeanMetric().to(device).update(value, weight)` does: the state it leaves, or the
    error."""
    metric = tt.WeightedMeanMetric().to(device)
    if not common_case:  # the full prologue for every input
        metric._ready_scalars = lambda *args: False  # type: ignore[method-assign]
    try:
        metric.update(value, weight)
    except Exception as error:
        return type(error).__name__, str(error)
    return "added", repr(metric.weighted_sum.local.item()), repr(metric.total_weight.local.item())


_ODD_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.complex64,
]


def _odd_input_pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    def tensor(number: float, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.uint64:
            return torch.tensor(2**60 + 1, dtype=torch.uint64)  # not exact in float64
        return torch.tensor(number, dtype=torch.float64).to(dtype)

    odd = [
        (torch.tensor(1.0), torch.tensor([1.0, 2.0])),
        (torch.tensor(1.0), torch.tensor([3.0])),
        (torch.tensor([1.0, 2.0]), torch.tensor(2)),
        (torch.tensor(1.0, device="meta"), torch.tensor(2.0)),
        (torch.tensor(1.0), torch.tensor(2.0, device="meta")),
        (torch.tensor(1.0), torch.tensor(-1)),
        (torch.tensor(float("nan")), torch.tensor(1)),
        (torch.tensor(1.0), torch.tensor(float("inf"))),
        (torch.tensor(1.0, requires_grad=True), torch.tensor(2)),
        (torch.tensor(1.0), torch.tensor(2.0, requires_grad=True)),
        (torch.nn.Parameter(torch.tensor(1.0)), torch.tensor(1)),
        (torch.tensor(1.0), torch.tensor(1 + 2j)),
    ]
    return [(tensor(3, value), tensor(2, weight)) for value in _ODD_DTYPES for weight in _ODD_DTYPES] + odd


def test_the_common_case_prologue_accepts_and_refuses_exactly_what_the_full_one_does() -> None:
    """`_ready_scalars` checks a 0-d value and a tensor weight in one expression and leaves the rest
    to torch's kernels: over every pair of input dtypes and odd inputs (another shape, the meta
    device, a negative or non-finite weight, autograd, uint64 that float64 cannot hold), the
    weighted mean ends with the same state or the same error either way."""
    differ = []
    for value, weight in _odd_input_pairs():
        fast = _weighted_mean_outcome(value, weight, common_case=True)
        full = _weighted_mean_outcome(value, weight, common_case=False)
        if fast != full and not (fast[0] == full[0] == "added" and "nan" in fast[1] and "nan" in full[1]):
            differ.append((value.dtype, weight.dtype, tuple(value.shape), str(value.device), fast, full))
    assert not differ, differ


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_common_case_prologue_on_cuda_takes_no_cpu_operand() -> None:
    """On a CUDA state a 0-d CPU operand goes through the full prologue (a kernel would take it as a
    scalar, and a CUDA graph would keep its value): same outcome either way, for every mix."""
    cpu, cuda = torch.tensor(2.5), torch.tensor(2.5, device="cuda")
    weights = [torch.tensor(512), torch.tensor(512, device="cuda"), torch.tensor(-1, device="cuda")]
    for value in (cpu, cuda, torch.tensor([2.5, 1.0], device="cuda")):
        for weight in weights:
            fast = _weighted_mean_outcome(value, weight, common_case=True, device="cuda")
            full = _weighted_mean_outcome(value, weight, common_case=False, device="cuda")
            assert fast == full, (value, weight, fast, full)
