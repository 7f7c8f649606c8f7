"""A metric belongs to one collector, at one path; its collector's storage changes only when it does."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector


def _pointers(metrics: dict[str, tt.Metric]) -> dict[str, list[int]]:
    return {
        name: [acc.local.data_ptr() for acc in metric.accumulators.values()]
        for name, metric in metrics.items()
    }


# -- a collector's storage survives anything that does not change its own metrics -----------------


def test_metrics_built_or_moved_elsewhere_leave_the_collectors_storage_alone() -> None:
    total = tt.SumMetric()
    with AsyncMetricCollector({"total": total}) as collector:
        before = total.total.local.data_ptr()
        for window in range(3):
            tt.SumMetric()  # built anywhere else in the process
            tt.HistogramMetric(bins=[1.0]).to("cpu")  # moved anywhere else
            other = tt.MaxMetric()
            other.extremum = tt.MetricAccumulator(0.0, "max")  # re-registered anywhere else
            total.update(float(window))
            collector.schedule_collection()
            assert collector.collect_results() == {"total": float(window)}
            assert total.total.local.data_ptr() == before  # a CUDA graph captured after bind() stays attached


def test_two_telemetries_in_one_process_never_rebuild_each_other() -> None:
    first = {"loss": tt.WeightedMeanMetric(), "confusion": tt.ConfusionMatrixMetric(8)}
    second = {"loss": tt.WeightedMeanMetric(), "worst": tt.MaxMetric()}
    telemetries = [tt.Telemetry(first, every=2), tt.Telemetry(second, every=3)]
    try:
        for metrics, telemetry in zip((first, second), telemetries, strict=True):
            metrics["loss"].update(torch.tensor(1.0))
            telemetry.step(0)
        pointers = [_pointers(first), _pointers(second)]
        for step in range(1, 40):
            for metrics, telemetry in zip((first, second), telemetries, strict=True):
                metrics["loss"].update(torch.tensor(float(step)), 2.0)
                telemetry.step(step)
            assert [_pointers(first), _pointers(second)] == pointers, f"storage rebuilt at step {step}"
        for telemetry in telemetries:
            telemetry.flush()
        assert telemetries[0].latest["loss"] == 38.5  # its last window: steps 38 and 39
        assert telemetries[1].latest["loss"] == 39.0  # flushed: step 39 alone
    finally:
        for telemetry in telemetries:
            telemetry.close()


def test_a_change_of_its_own_metric_is_picked_up_at_the_next_window() -> None:
    metric = tt.SumMetric()
    with AsyncMetricCollector(metric) as collector:
        metric.update(1.0)
        collector.schedule_collection()
        assert collector.collect_results() == 1.0
        metric.total = tt.MetricAccumulator(0.0, "sum", dtype=torch.float64)  # replaced: rebuilt
        metric.update(4.0)
        collector.schedule_collection()
        assert collector.collect_results() == 4.0
        moved_away = metric.total.local.data_ptr()
        metric.total.to("cpu")  # same device: nothing moves
        assert metric.total.local.data_ptr() == moved_away


# -- one metric, one place ------------------------------------------------------------------------


def test_a_metric_in_two_telemetries_is_refused_naming_it_and_both_places() -> None:
    shared = tt.SumMetric(kind="counter")
    first = tt.Telemetry({"tokens": shared}, every=1)
    try:
        with pytest.raises(ValueError) as raised:
            tt.Telemetry({"train": {"seen": shared}}, every=1)
        message = str(raised.value)
        assert "metric 'train/seen' (SumMetric) is already collected by the AsyncMetricCollector" in message
        assert "test_binding.py" in message and "(as 'tokens')" in message
        assert "Call unbind() (or close()) on the other first" in message
        shared.update(2.0)
        first.step(0)
        first.flush()
        assert first.latest["tokens"] == 2.0  # the first one lost nothing
    finally:
        first.close()
    second = tt.Telemetry({"seen": shared}, every=1)  # close() released the claim
    shared.update(3.0)
    second.step(1)
    second.close()
    assert second.latest["seen"] == 3.0


def test_a_metric_at_two_paths_of_one_tree_is_refused() -> None:
    shared = tt.WeightedMeanMetric()
    with pytest.raises(ValueError, match=r"the same WeightedMeanMetric object is at 'a' and 'b/c'"):
        AsyncMetricCollector({"a": shared, "b": {"c": shared}}).bind()
    with AsyncMetricCollector({"a": shared}) as collector:  # nothing was claimed by the refused bind
        shared.update(torch.tensor(3.0))
        collector.schedule_collection()
        assert collector.collect_results() == {"a": 3.0}


def test_unbind_releases_and_copies_are_bound_nowhere() -> None:
    metric = tt.MinMetric()
    first = AsyncMetricCollector(metric).bind()
    for copied in (copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        with AsyncMetricCollector(copied) as collector:  # a copy is a metric of its own
            collector.schedule_collection()
            assert collector.collect_results() == math.inf
    with pytest.raises(ValueError, match="already collected by"):
        AsyncMetricCollector(metric).bind()
    first.unbind()
    with AsyncMetricCollector(metric) as collector:
        metric.update(-2.0)
        collector.schedule_collection()
        assert collector.collect_results() == -2.0
