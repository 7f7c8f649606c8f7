"""Bad input, one table row per case: a clear error naming the metric, or the documented handling,
and never a loss of what was already accumulated. docs/reliability.md "Bad input" lists every row.

tests/metric/test_metrics.py already covers the basic cases (NaN under each policy for the
aggregating metrics, negative weights, logits shapes, float targets, out-of-range targets with
logits, AUROC targets, a meta input to a CPU metric, strings, empty batches, histogram edges);
these are the rest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import torchtelemetry as tt
from tests.metric.examples import EXAMPLES, PATHS, build, feed, on_path
from tests.metric.test_metrics import _good_input, assert_same_state, computed, states
from torchtelemetry.export import PrometheusExporter

NAN, INF = float("nan"), float("inf")
BINS = [1.0, 2.0]


@dataclass(frozen=True)
class Row:
    """One bad input: fed after a good one, it raises `error` matching `match` and changes no state,
    or (error None) it is handled as `check` asserts on the computed result."""

    make: Callable[[], tt.Metric]
    args: tuple
    error: type[Exception] | None = None
    match: str = ""
    check: Callable[[Any, tt.Metric], Any] | None = None
    good: tuple | None = None
    """The good input fed first (default: `_good_input` of tests/metric/test_metrics.py)."""


def _equals(expected: Any) -> Callable[[Any, tt.Metric], None]:
    def check(result: Any, metric: tt.Metric) -> None:
        actual = {k: v.tolist() for k, v in result.items()} if isinstance(result, dict) else result.tolist()
        np.testing.assert_equal(actual, expected)

    return check


def _total(attr: str, expected: float) -> Callable[[Any, tt.Metric], None]:
    """The accumulator `attr` holds `expected`: the bad entries were skipped, the good ones kept."""

    def check(result: Any, metric: tt.Metric) -> None:
        assert metric.accumulators[attr].local.sum().item() == expected

    return check


# Good inputs (from _good_input): Sum/Max/Histogram/PerRank 4.0; weighted mean of [1, 2] with
# weights [1, 3] = 1.75; accuracy 3/3; confusion pairs (0, 0), (1, 2); AUROC 1.0.
ROWS: dict[str, Row] = {
    # -- NaN / Inf under each nan_policy ------------------------------------------------------
    "accuracy NaN logits, error": Row(
        lambda: tt.AccuracyMetric(nan_policy="error"),
        (torch.tensor([[NAN, 0.0, 1.0]]), torch.tensor([2])),
        ValueError,
        r"AccuracyMetric: preds contains NaN or Inf and nan_policy='error'",
    ),
    "accuracy NaN logits, ignore: sample skipped": Row(
        lambda: tt.AccuracyMetric(nan_policy="ignore"),
        (torch.tensor([[NAN, 0.0, 1.0], [0.0, 0.0, 1.0]]), torch.tensor([2, 2])),
        check=_total("total", 4),  # 3 good + the finite row; both rows' predictions are right
    ),
    "accuracy NaN logits, propagate: NaN ranks highest": Row(
        tt.AccuracyMetric, (torch.tensor([[NAN, 0.0, 1.0]]), torch.tensor([2])), check=_equals(0.75)
    ),
    "confusion Inf logits, error": Row(
        lambda: tt.ConfusionMatrixMetric(3, nan_policy="error"),
        (torch.tensor([[INF, 0.0, 1.0]]), torch.tensor([2])),
        ValueError,
        r"ConfusionMatrixMetric: preds contains NaN or Inf",
    ),
    "confusion NaN logits, ignore: sample skipped": Row(
        lambda: tt.ConfusionMatrixMetric(3, nan_policy="ignore"),
        (torch.tensor([[NAN, 0.0, 1.0]]), torch.tensor([2])),
        check=_total("matrix", 2),
    ),
    "AUROC NaN score, propagate: sample skipped": Row(
        tt.BinaryAUROCMetric, (torch.tensor([NAN, 0.1]), torch.tensor([1, 1])), check=_total("positives", 2)
    ),
    "counter NaN, propagate: total becomes NaN": Row(
        lambda: tt.SumMetric(kind="counter"), (torch.tensor([NAN]),), check=_equals(NAN)
    ),
    "counter NaN, ignore: skipped": Row(
        lambda: tt.SumMetric(kind="counter", nan_policy="ignore"),
        (torch.tensor([NAN, 1.0]),),
        check=_equals(5.0),
    ),
    "counter +Inf, propagate": Row(lambda: tt.SumMetric(kind="counter"), (INF,), check=_equals(INF)),
    "counter -Inf": Row(
        lambda: tt.SumMetric(kind="counter"), (-INF,), ValueError, "SumMetric: a counter cannot decrease"
    ),
    "max +Inf, propagate": Row(tt.MaxMetric, (torch.tensor([INF]),), check=_equals(INF)),
    "max +Inf, ignore: skipped": Row(
        lambda: tt.MaxMetric(nan_policy="ignore"), (torch.tensor([INF, 5.0]),), check=_equals(5.0)
    ),
    "weighted mean NaN weight, propagate": Row(tt.WeightedMeanMetric, (1.0, NAN), check=_equals(NAN)),
    "weighted mean -Inf weight": Row(
        tt.WeightedMeanMetric, (1.0, -INF), ValueError, "WeightedMeanMetric: weight must be non-negative"
    ),
    "histogram +Inf, propagate: +Inf bucket": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.tensor([INF]),),
        check=_equals({"bounds": BINS, "counts": [0, 0, 2], "sum": INF, "count": 2}),
    ),
    "histogram -Inf, propagate: first bucket": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.tensor([-INF]),),
        check=_equals({"bounds": BINS, "counts": [1, 0, 1], "sum": -INF, "count": 2}),
    ),
    "histogram NaN, propagate: +Inf bucket, sum NaN": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.tensor([NAN]),),
        check=_equals({"bounds": BINS, "counts": [0, 0, 2], "sum": NAN, "count": 2}),
    ),
    # -- zero and negative weights ------------------------------------------------------------------
    "zero weights: nothing counted": Row(
        tt.WeightedMeanMetric, (torch.tensor([9.0, 9.0]), torch.zeros(2)), check=_equals(1.75)
    ),
    "zero scalar weight": Row(tt.WeightedMeanMetric, (9.0, 0), check=_equals(1.75)),
    "negative zero weight": Row(tt.WeightedMeanMetric, (9.0, -0.0), check=_equals(1.75)),
    "boolean weights: a mask": Row(
        tt.WeightedMeanMetric, (torch.tensor([10.0, 20.0]), torch.tensor([True, False])), check=_equals(3.4)
    ),
    # -- shapes ---------------------------------------------------------------------------------------
    "weight shape differs from value": Row(
        tt.WeightedMeanMetric,
        (torch.ones(2, 2), torch.ones(2)),
        ValueError,
        r"WeightedMeanMetric: weight has shape \(2,\), expected the shape of value \(2, 2\) or a scalar",
    ),
    "accuracy label predictions shape": Row(
        tt.AccuracyMetric,
        (torch.tensor([1, 2, 0]), torch.tensor([1, 2])),
        ValueError,
        r"AccuracyMetric: label predictions have shape \(3,\)",
    ),
    "accuracy boolean predictions": Row(
        tt.AccuracyMetric, (torch.tensor([True]), torch.tensor([1])), ValueError, "dtype torch.bool"
    ),
    "confusion label predictions shape": Row(
        lambda: tt.ConfusionMatrixMetric(3),
        (torch.tensor([1, 2]), torch.tensor([1])),
        ValueError,
        r"ConfusionMatrixMetric: label predictions have shape \(2,\)",
    ),
    "histogram 2-D values: every entry": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.tensor([[0.5, 1.0], [1.5, 3.0]]),),
        check=_equals({"bounds": BINS, "counts": [2, 1, 2], "sum": 10.0, "count": 5}),
    ),
    "per-rank 2-D values: every entry": Row(
        lambda: tt.PerRankMetric(2, 0), (torch.full((2, 2), 2.0),), check=_equals([2.4, NAN])
    ),
    # -- dtypes ----------------------------------------------------------------------------------------
    "complex value": Row(
        tt.SumMetric,
        (torch.tensor([1 + 2j]),),
        TypeError,
        "SumMetric: value has complex dtype torch.complex64",
    ),
    "complex numpy histogram values": Row(
        lambda: tt.HistogramMetric(BINS), (np.array([1j]),), TypeError, "HistogramMetric: value has complex"
    ),
    "complex weight": Row(
        tt.WeightedMeanMetric, (1.0, 1j), TypeError, "WeightedMeanMetric: weight has complex dtype"
    ),
    "Python int beyond int64": Row(
        tt.SumMetric, (2**70,), ValueError, "SumMetric: value=1180591620717411303424 does not fit in a 64-bit"
    ),
    "float16 value": Row(tt.SumMetric, (torch.tensor([1.5], dtype=torch.float16),), check=_equals(5.5)),
    "bfloat16 value": Row(
        tt.SumMetric, (torch.tensor([0.1], dtype=torch.bfloat16),), check=_equals(4.0 + 0.10009765625)
    ),
    "bfloat16 value on an edge: its own bucket": Row(
        lambda: tt.HistogramMetric([0.1, 2.0]),
        (torch.tensor([0.1], dtype=torch.bfloat16),),
        check=_equals({"bounds": [0.1, 2.0], "counts": [1, 0, 1], "sum": 4.10009765625, "count": 2}),
    ),
    "integer values on edges": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.tensor([1, 2, 3]),),
        check=_equals({"bounds": BINS, "counts": [1, 1, 2], "sum": 10.0, "count": 4}),
    ),
    "uint8 targets": Row(
        tt.AccuracyMetric, (torch.eye(3)[:1], torch.tensor([0], dtype=torch.uint8)), check=_equals(1.0)
    ),
    "float into an integer state: sum": Row(
        lambda: tt.SumMetric(dtype=torch.int64),
        (0.5,),
        TypeError,
        r"SumMetric: value has dtype torch.float64, but the metric's state is torch.int64",
        good=(torch.tensor([4]),),
    ),
    "float into an integer state: histogram": Row(
        lambda: tt.HistogramMetric(BINS, dtype=torch.int64),
        (torch.tensor([0.5]),),
        TypeError,
        r"HistogramMetric: value has dtype torch.float32, but the metric's state is torch.int64",
        good=(torch.tensor([4]),),
    ),
    "float into an integer state: per-rank": Row(
        lambda: tt.PerRankMetric(2, 0, dtype=torch.int64),
        (torch.tensor([0.5]),),
        TypeError,
        r"PerRankMetric: value has dtype torch.float32, but the metric's state is torch.int64",
        good=(torch.tensor([4]),),
    ),
    "float into an integer state: weighted mean": Row(
        lambda: tt.WeightedMeanMetric(dtype=torch.int64),
        (0.5, 2),
        TypeError,
        r"WeightedMeanMetric: value has dtype torch.float64, but the metric's state is torch.int64",
        good=(torch.tensor([4]), torch.tensor([1])),
    ),
    # -- limits: batches reduce in the state dtype, integer states never wrap --------------------------
    "float16 batch beyond float16 range: sum": Row(
        tt.SumMetric, (torch.full((3,), 30000.0, dtype=torch.float16),), check=_equals(90004.0)
    ),
    "float32 batch beyond float32 range: sum": Row(
        tt.SumMetric, (torch.full((4,), 1e38),), check=_equals(4.0 + 4 * float(torch.tensor(1e38)))
    ),
    "bfloat16 batch beyond bfloat16 range: sum": Row(
        tt.SumMetric,
        (torch.full((2,), 3e38, dtype=torch.bfloat16),),
        check=_equals(4.0 + 2 * float(torch.tensor(3e38, dtype=torch.bfloat16))),
    ),
    "float32 products beyond float32 range: weighted mean": Row(
        lambda: tt.WeightedMeanMetric(nan_policy="error"),
        (torch.tensor([1e38, 1e38]), torch.tensor([10.0, 10.0])),
        check=_total("weighted_sum", 7.0 + 20 * float(torch.tensor(1e38))),
    ),
    "float32 product beyond float32 range: 0-d weighted mean": Row(
        tt.WeightedMeanMetric,
        (torch.tensor(1e38), torch.tensor(10.0)),
        check=_total("weighted_sum", 7.0 + 10 * float(torch.tensor(1e38))),
    ),
    "float16 batch beyond float16 range: histogram sum": Row(
        lambda: tt.HistogramMetric(BINS, nan_policy="error"),
        (torch.full((3,), 30000.0, dtype=torch.float16),),
        check=_equals({"bounds": BINS, "counts": [0, 0, 4], "sum": 90004.0, "count": 4}),
    ),
    "float16 batch beyond float16 range: per-rank": Row(
        lambda: tt.PerRankMetric(1, 0),
        (torch.full((3,), 30000.0, dtype=torch.float16),),
        check=_total("sums", 90004.0),
    ),
    "int64 batch beyond int64: default counter": Row(
        lambda: tt.SumMetric(kind="counter"),
        (torch.tensor([2**62, 2**62]),),
        check=_equals(4.0 + 2.0**63),
    ),
    "int64 batch wrapping an int64 counter": Row(
        lambda: tt.SumMetric(kind="counter", dtype=torch.int64),
        (torch.tensor([2**62, 2**62]),),
        ValueError,
        r"SumMetric: the total would leave the range of its state dtype torch.int64",
        good=(torch.tensor([4]),),
    ),
    "int64 counter at its maximum": Row(
        lambda: tt.SumMetric(kind="counter", dtype=torch.int64),
        (1,),
        ValueError,
        r"SumMetric: the total would leave the range of its state dtype torch.int64",
        good=(2**63 - 1,),
    ),
    "int32 state wrapping": Row(
        lambda: tt.SumMetric(dtype=torch.int32),
        (torch.tensor([2**31 - 4], dtype=torch.int32),),
        ValueError,
        r"range of its state dtype torch.int32",
        good=(torch.tensor([4], dtype=torch.int32),),
    ),
    "int64 histogram sum wrapping": Row(
        lambda: tt.HistogramMetric(BINS, dtype=torch.int64),
        (torch.tensor([2**63 - 1]),),
        ValueError,
        r"HistogramMetric: the total would leave the range of its state dtype torch.int64",
        good=(torch.tensor([4]),),
    ),
    "int64 products wrapping an int64 weighted mean": Row(
        lambda: tt.WeightedMeanMetric(dtype=torch.int64),
        (torch.tensor([2**62]), torch.tensor([4])),
        ValueError,
        r"WeightedMeanMetric: the total would leave the range",
        good=(torch.tensor([4]), torch.tensor([1])),
    ),
    "integers beyond 2**53 on a histogram edge: exact": Row(
        lambda: tt.HistogramMetric([2.0**53, 2.0**60]),
        (torch.tensor([2**53, 2**53 + 1, 2**60, 2**60 + 1]),),
        check=lambda result, metric: np.testing.assert_equal(result["counts"].tolist(), [2, 2, 1]),
    ),
    # -- devices (`meta` stands in for another device) ------------------------------------------------
    "weight on another device": Row(
        tt.WeightedMeanMetric,
        (torch.ones(2), torch.ones(2, device="meta")),
        ValueError,
        "WeightedMeanMetric: weight is on meta, but the metric lives on cpu",
    ),
    "0-d value on another device": Row(
        tt.SumMetric, (torch.tensor(1.0, device="meta"),), ValueError, "SumMetric: value is on meta"
    ),
    "logits on another device": Row(
        tt.AccuracyMetric,
        (torch.zeros(1, 3, device="meta"), torch.tensor([0])),
        ValueError,
        "AccuracyMetric: preds is on meta",
    ),
    "targets on another device": Row(
        lambda: tt.ConfusionMatrixMetric(3),
        (torch.tensor([0]), torch.tensor([0], device="meta")),
        ValueError,
        "ConfusionMatrixMetric: target is on meta",
    ),
    "AUROC targets on another device": Row(
        tt.BinaryAUROCMetric,
        (torch.tensor([0.5]), torch.tensor([1], device="meta")),
        ValueError,
        "BinaryAUROCMetric: target is on meta",
    ),
    "histogram values on another device": Row(
        lambda: tt.HistogramMetric(BINS),
        (torch.ones(2, device="meta"),),
        ValueError,
        "HistogramMetric: value is on",
    ),
    # -- non-tensor inputs ----------------------------------------------------------------------------
    "None value": Row(tt.MinMetric, (None,), TypeError, "MinMetric: value must be a tensor or a number"),
    "None weight": Row(tt.WeightedMeanMetric, (1.0, None), TypeError, "weight must be a tensor or a number"),
    "dict value": Row(
        tt.SumMetric, ({"a": 1.0},), TypeError, "SumMetric: value must be a tensor or a number"
    ),
    "ragged list": Row(
        tt.SumMetric, ([1.0, [2.0]],), TypeError, "value must be a tensor or a number, got list"
    ),
    # -- empty batches ---------------------------------------------------------------------------------
    "empty per-rank batch": Row(lambda: tt.PerRankMetric(2, 0), (torch.empty(0),), check=_equals([4.0, NAN])),
    "empty min batch": Row(tt.MinMetric, (torch.empty(0),), check=_equals(4.0)),
    "empty label batch": Row(
        tt.AccuracyMetric,
        (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)),
        check=_equals(1.0),
    ),
    "empty values with a scalar weight": Row(
        tt.WeightedMeanMetric, (torch.empty(0), 2.0), check=_equals(1.75)
    ),
    # -- labels out of range ------------------------------------------------------------------------------
    "negative target": Row(
        tt.AccuracyMetric,
        (torch.zeros(1, 3), torch.tensor([-1])),
        ValueError,
        r"AccuracyMetric: target has labels outside \[0, 3\); set ignore_index",
    ),
    "label target above num_classes": Row(
        lambda: tt.AccuracyMetric(num_classes=3),
        (torch.tensor([5]), torch.tensor([5])),
        ValueError,
        r"target has labels outside \[0, 3\)",
    ),
    "ignored target skipped": Row(
        lambda: tt.AccuracyMetric(ignore_index=-100),
        (torch.eye(3)[:1], torch.tensor([-100])),
        check=_total("total", 3),
    ),
    "labels without num_classes: compared as given": Row(
        tt.AccuracyMetric, (torch.tensor([7]), torch.tensor([7])), check=_equals(1.0)
    ),
    "AUROC scores outside [0, 1]: clamped": Row(
        tt.BinaryAUROCMetric, (torch.tensor([-0.5, 1.5]), torch.tensor([0, 1])), check=_equals(1.0)
    ),
    "confusion ignored target skipped": Row(
        lambda: tt.ConfusionMatrixMetric(3, ignore_index=-1),
        (torch.tensor([0]), torch.tensor([-1])),
        check=_total("matrix", 2),
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_bad_input_raises_or_is_handled_and_keeps_what_was_accumulated(row: Row) -> None:
    metric = row.make()
    metric.update(*(row.good if row.good is not None else _good_input(metric)))
    before = states(metric)
    if row.error is not None:
        with pytest.raises(row.error, match=row.match):
            metric.update(*row.args)
        assert_same_state(before, metric)
        return
    metric.update(*row.args)
    assert row.check is not None
    row.check(computed(metric), metric)


# -- every exported metric, each argument of each example it declares --------------------------------


def _bad_arguments(example: tt.metric.MetricExample) -> list[tuple[tuple, type[Exception], str]]:
    """Each argument of each update of `example` in turn made bad: a string (no tensor, no number),
    and a tensor on another device (`meta`) than the metric's."""
    cases: list[tuple[tuple, type[Exception], str]] = []
    for args in example.updates:
        for position, arg in enumerate(args):
            before, after = args[:position], args[position + 1 :]
            cases.append(((*before, "many", *after), TypeError, "must be a tensor or a number"))
            if isinstance(arg, torch.Tensor):
                moved = (*before, arg.to("meta"), *after)
                cases.append((moved, ValueError, "is on meta, but the metric lives on cpu"))
    return cases


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_every_metric_refuses_bad_arguments_naming_itself_and_keeps_its_state(
    cls: type[tt.Metric], example: tt.metric.MetricExample, path: str
) -> None:
    """Staged or not, a refused update raises at `update()` and records nothing."""
    metric = feed(on_path(build(cls, example, name="val/bad"), path), example)
    before = states(metric)
    for args, error, message in _bad_arguments(example):
        with pytest.raises(error, match=rf"^{cls.__name__} 'val/bad': \w+ {message}"):
            metric.update(*args)
        assert_same_state(before, metric)


# -- non-tensor inputs give what the same tensors give -----------------------------------------------

NON_TENSOR = {
    "Python float": (tt.SumMetric, (2.5,), (torch.tensor(2.5),)),
    "numpy float32 scalar": (tt.MaxMetric, (np.float32(2.5),), (torch.tensor(2.5),)),
    "numpy int64 scalar": (tt.MinMetric, (np.int64(-3),), (torch.tensor(-3),)),
    "Python bool": (tt.SumMetric, (True,), (torch.tensor(1.0),)),
    "numpy arrays, value and weight": (
        tt.WeightedMeanMetric,
        (np.array([1.0, 3.0]), np.array([1.0, 2.0])),
        (torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])),
    ),
    "Python list": (lambda: tt.PerRankMetric(2, 1), ([1.0, 2.0],), (torch.tensor([1.0, 2.0]),)),
    "numpy histogram values": (
        lambda: tt.HistogramMetric(BINS),
        (np.array([0.5, 1.0, 2.5], dtype=np.float32),),
        (torch.tensor([0.5, 1.0, 2.5]),),
    ),
    "numpy logits, list targets": (
        tt.AccuracyMetric,
        (np.eye(3)[[0, 2]], [0, 1]),
        (torch.eye(3, dtype=torch.float64)[[0, 2]], torch.tensor([0, 1])),
    ),
    "lists of labels": (
        lambda: tt.ConfusionMatrixMetric(3),
        ([0, 2], [0, 1]),
        (torch.tensor([0, 2]), torch.tensor([0, 1])),
    ),
    "numpy scores, list targets": (
        tt.BinaryAUROCMetric,
        (np.array([0.2, 0.7]), [0, 1]),
        (torch.tensor([0.2, 0.7], dtype=torch.float64), torch.tensor([0, 1])),
    ),
}


@pytest.mark.parametrize(("make", "given", "as_tensors"), NON_TENSOR.values(), ids=NON_TENSOR.keys())
def test_non_tensor_inputs_count_like_the_same_tensors(make, given, as_tensors) -> None:
    metric, twin = make(), make()
    metric.update(*given)
    twin.update(*as_tensors)
    torch.testing.assert_close(computed(metric), computed(twin), rtol=0, atol=0, equal_nan=True)


def test_a_metric_on_another_device_takes_numbers_but_not_host_tensors() -> None:
    metric = tt.SumMetric().to("meta")
    for number in (1.0, 3, np.float64(2.0), torch.tensor(1.0)):  # filled on the device, no host copy
        metric.update(number)
    with pytest.raises(ValueError, match=r"SumMetric: value is on cpu, but the metric lives on meta"):
        metric.update(torch.ones(3))
    assert metric.total.local.device.type == "meta"


# -- metric names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"": tt.SumMetric()}, "metric name '': must be a non-empty string"),
        ({"train": {"": tt.SumMetric()}}, "segment '' must be non-empty"),
        ({"a" * 201: tt.SumMetric()}, "201 characters, at most 200 allowed"),
        ({"lösung": tt.SumMetric()}, "segment 'lösung' must be non-empty and use only letters"),
        ({'say "hi"': tt.SumMetric()}, "use only letters, digits"),
        ({"line\nbreak": tt.SumMetric()}, "use only letters, digits"),
    ],
    ids=["empty", "empty segment", "too long", "unicode", "quotes", "newline"],
)
def test_illegal_metric_names_fail_when_telemetry_is_built(metrics: dict, message: str) -> None:
    with pytest.raises(tt.report.InvalidMetricNameError, match=message):
        tt.Telemetry(metrics, [], signals=False)


def test_the_longest_legal_name_is_accepted() -> None:
    name = "a" * 200
    with tt.Telemetry({name: tt.SumMetric()}, [], signals=False, hang_after_s=None) as telemetry:
        assert [d.name for d in telemetry.descriptors] == [name]


def test_names_that_one_backend_cannot_tell_apart_fail_when_telemetry_is_built() -> None:
    metrics = {"train": {"loss-x": tt.SumMetric(), "loss_x": tt.SumMetric()}}
    with pytest.raises(
        tt.report.NameCollisionError,
        match=r"\['train/loss-x', 'train/loss_x'\] -> 'torchtelemetry_train_loss_x'",
    ):
        tt.Telemetry(metrics, [PrometheusExporter(port=None, registry=CollectorRegistry())], signals=False)


# -- label values and a bad update in the loop -----------------------------------------------------------

AWKWARD_LABELS = {'quote "q"': 1.0, "new\nline": 2.0, "ünïcødé ✓": 3.0, "back\\slash": 4.0}


def test_awkward_label_values_and_run_id_reach_jsonl_intact(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    run_id = 'run "7"\nü'
    with tt.Telemetry(
        {"x": tt.SumMetric()}, [tt.JsonlExporter(path)], signals=False, run_id=run_id
    ) as telemetry:
        telemetry.log({"eval/score": AWKWARD_LABELS}, step=3)
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert record["run_id"] == run_id
    assert record["values"]["eval/score"] == AWKWARD_LABELS


def test_a_bad_update_inside_the_loop_loses_nothing_already_accumulated(tmp_path: Path) -> None:
    metrics = {"loss": tt.WeightedMeanMetric(), "tokens": tt.SumMetric(kind="counter")}
    with tt.Telemetry(metrics, [], every=2, signals=False) as telemetry:
        for step in range(4):
            metrics["loss"].update(torch.tensor(float(step)), 2.0)
            metrics["tokens"].update(10.0)
            with pytest.raises(ValueError, match="weight must be non-negative"):
                metrics["loss"].update(torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0]))
            with pytest.raises(ValueError, match="a counter cannot decrease"):
                metrics["tokens"].update(-5.0)
            telemetry.step(step)
        telemetry.flush()
        assert telemetry.latest == {"loss": 2.5, "tokens": 40.0}
        assert not math.isnan(telemetry.latest["loss"])


# -- float8 and unsigned integer inputs ------------------------------------------------------------

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
UNSIGNED = [torch.uint8, torch.uint16, torch.uint32]


def _values(dtype: torch.dtype) -> tuple:
    return (
        (torch.tensor([0.5, 1.0, 3.0, 240.0]).to(dtype),)
        if dtype in FLOAT8
        else (torch.tensor([0, 1, 3, 200]).to(dtype),)
    )


def _label_pairs(dtype: torch.dtype) -> tuple:
    """Labels up to 19 (of 20 classes): 19 * 20 + 19 wraps a uint8 confusion-matrix cell index."""
    return torch.tensor([19, 3, 0, 19]).to(dtype), torch.tensor([19, 3, 1, 2]).to(dtype)


# Every built-in, fed each dtype where it takes it: values, weights, logits, labels, AUROC scores/targets.
WIDENED_INPUTS: dict[str, tuple[Callable[[], tt.Metric], Callable[[torch.dtype], tuple]]] = {
    "sum": (tt.SumMetric, _values),
    "counter": (lambda: tt.SumMetric(kind="counter"), _values),
    "weighted mean": (tt.WeightedMeanMetric, lambda d: (*_values(d), *_values(d))),
    "0-d weighted mean": (tt.WeightedMeanMetric, lambda d: (_values(d)[0][2], _values(d)[0][1])),
    "max": (tt.MaxMetric, _values),
    "min": (tt.MinMetric, _values),
    "per-rank": (lambda: tt.PerRankMetric(2, 1), _values),
    "histogram": (lambda: tt.HistogramMetric([0.5, 1.0, 2.0, 240.0]), _values),
    "accuracy": (
        lambda: tt.AccuracyMetric(num_classes=20),
        lambda d: (
            (torch.eye(20)[[19, 3, 1, 2]].to(d), _label_pairs(torch.uint8)[1])
            if d in FLOAT8
            else _label_pairs(d)
        ),
    ),
    "top-2 accuracy": (
        lambda: tt.AccuracyMetric(top_k=2),
        lambda d: (
            (torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.5, 1.0]]).to(d), torch.tensor([2, 1]))
            if d in FLOAT8
            else (torch.tensor([[0.5, 2.0, 1.0], [3.0, 0.5, 1.0]]), torch.tensor([2, 1]).to(d))
        ),
    ),
    "confusion matrix": (
        lambda: tt.ConfusionMatrixMetric(20),
        lambda d: (
            (torch.eye(20)[[19, 3, 1, 2]].to(d), _label_pairs(torch.uint8)[1])
            if d in FLOAT8
            else _label_pairs(d)
        ),
    ),
    "AUROC": (
        tt.BinaryAUROCMetric,
        lambda d: (
            (torch.tensor([0.25, 0.75, 0.5]).to(d), torch.tensor([0, 1, 1]))
            if d in FLOAT8
            else (torch.tensor([0.25, 0.75, 0.5]), torch.tensor([0, 1, 1]).to(d))
        ),
    ),
}


def _exact_twin(args: tuple) -> tuple:
    """The same values in dtypes every op takes: float8 as float32, unsigned integers as int64."""
    return tuple(
        arg.float() if arg.dtype in FLOAT8 else arg.long() if arg.dtype in UNSIGNED else arg for arg in args
    )


@pytest.mark.parametrize("dtype", FLOAT8 + UNSIGNED, ids=str)
@pytest.mark.parametrize(("make", "build"), WIDENED_INPUTS.values(), ids=WIDENED_INPUTS.keys())
def test_float8_and_unsigned_inputs_count_as_their_exact_values(make, build, dtype: torch.dtype) -> None:
    metric, twin = make(), make()
    args = build(dtype)
    assert {arg.dtype for arg in args} & {dtype}, "the dtype under test is fed"
    metric.update(*args)
    twin.update(*_exact_twin(args))
    torch.testing.assert_close(computed(metric), computed(twin), rtol=0, atol=0, equal_nan=True)


def test_uint8_labels_do_not_wrap_the_confusion_matrix_cell() -> None:
    metric = tt.ConfusionMatrixMetric(20)
    metric.update(*_label_pairs(torch.uint8))
    assert metric.matrix.value[19, 19].item() == 1.0 and metric.matrix.value.sum().item() == 4.0


@pytest.mark.parametrize(("make", "build"), WIDENED_INPUTS.values(), ids=WIDENED_INPUTS.keys())
def test_uint64_input_raises_naming_the_metric_and_keeps_the_state(make, build) -> None:
    metric = make()
    metric.update(*_exact_twin(build(torch.uint8)))
    before = states(metric)
    args = tuple(arg.to(torch.uint64) if arg.dtype == torch.uint8 else arg for arg in build(torch.uint8))
    name = type(metric).__name__
    with pytest.raises(TypeError, match=rf"{name}: \w+ has dtype torch.uint64, which no metric state holds"):
        metric.update(*args)
    assert_same_state(before, metric)
