"""Batched compute and `sync_and_compute`: the values of each metric's own `compute()`, in a number
of tensor ops that does not grow with the number of built-in metrics."""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import pytest
import torch

import torchtelemetry as tt
from tests.collect.test_collector import assert_same, expected_window, feed_window, make_metrics
from tests.distributed import run_ranks
from tests.metric.examples import EXAMPLE_CASES, build, feed
from tests.ops import OpCounter
from tests.sync.collectives import CollectiveCounter
from tests.trees import pytree
from torchtelemetry.collect import AsyncMetricCollector, WindowPlan
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import to_python
from torchtelemetry.sync import WindowExchange


def every_builtin(copies: int) -> dict[str, tt.Metric]:
    """`copies` instances of every example of every exported metric (tests/metric/examples.py), the
    i-th fed its example's inputs i % 3 times (none: the empty state)."""
    return {
        f"{cls.__name__}_{index}_{i}": feed(build(cls, example), example, times=i % 3)
        for index, (cls, example) in enumerate(EXAMPLE_CASES)
        for i in range(copies)
    }


def blocking_results(metrics: Any) -> Any:
    tt.sync_metrics(metrics)
    return to_python(pytree.tree_map(lambda metric: metric.compute(), metrics))


def test_batched_results_equal_each_metrics_own_compute() -> None:
    metrics = every_builtin(3)
    expected = blocking_results(metrics)
    assert_same(tt.sync_and_compute(metrics), expected)
    with AsyncMetricCollector(metrics) as collector:
        collector.schedule_collection()
        assert_same(collector.collect_results(), expected)


def test_ops_per_window_do_not_grow_with_the_number_of_builtin_metrics() -> None:
    counts = {}
    for copies in (2, 24):
        metrics = every_builtin(copies)
        expected = blocking_results(metrics)
        tt.sync_and_compute(metrics)  # builds and caches the plan
        with OpCounter() as counter:
            results = tt.sync_and_compute(metrics)
        assert_same(results, expected)
        counts[copies] = counter.ops
    assert counts[2] == counts[24]
    assert sum(counts[24].values()) < 200  # for 24 copies of every example: 792 metrics of 9 classes


class RangeMetric(tt.Metric):
    """A custom metric: its own compute(), with a non-tensor leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.high = tt.MetricAccumulator(-math.inf, "max", dtype=torch.float64)
        self.low = tt.MetricAccumulator(math.inf, "min", dtype=torch.float64)

    def update(self, value: torch.Tensor) -> None:
        self.high.update(value.amax())
        self.low.update(value.amin())

    def compute(self) -> dict[str, Any]:
        return {
            "range": self.high.value - self.low.value,
            "version": 2,
            "seen": self.high.value > self.low.value,
        }


@pytest.mark.parametrize("transport", ["host", "device"])
def test_a_custom_metric_replacing_its_accumulator_in_flight_loses_neither_window(transport: str) -> None:
    """The window in flight computes from the state it snapshotted, through the accumulators it was
    laid out with; the next window lays the new one out. (Before: the worker looked the metric's new
    accumulator up in the window's state and failed the collection with a KeyError.)"""
    metric = RangeMetric()
    with AsyncMetricCollector({"range": metric}, transport=transport) as collector:  # type: ignore[arg-type]
        metric.update(torch.tensor([1.0, 4.5]))
        worker = collector._executor
        assert worker is not None
        held = threading.Event()
        worker.submit(held.wait, 60)  # the window below waits for it on the worker
        collector.schedule_collection()
        metric.high = tt.MetricAccumulator(-math.inf, "max", dtype=torch.float64)
        held.set()
        assert_same(collector.collect_results(), {"range": {"range": 3.5, "version": 2, "seen": True}})
        metric.update(torch.tensor([2.0, 3.0]))
        collector.schedule_collection()
        assert_same(collector.collect_results(), {"range": {"range": 1.0, "version": 2, "seen": True}})


class DoubledSum(tt.SumMetric):
    """A subclass of a built-in that overrides compute(): its own compute() must be used."""

    def compute(self) -> torch.Tensor:
        return self.total.value * 2


@pytest.mark.parametrize("transport", ["host", "device"])
def test_custom_metrics_and_overriding_subclasses_use_their_own_compute(transport: str) -> None:
    metrics = {"range": RangeMetric(), "doubled": DoubledSum(), "sum": tt.SumMetric()}
    for metric in metrics.values():
        metric.update(torch.tensor([1.0, 4.5]))
    expected = {"range": {"range": 3.5, "version": 2, "seen": True}, "doubled": 11.0, "sum": 5.5}
    assert_same(tt.sync_and_compute(metrics), expected)
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        collector.schedule_collection()  # device: custom metrics from their states copied apart
        assert_same(collector.collect_results(), expected)


class LeadingCounts(tt.Metric):
    """A custom compute() that reads a value on the host (`.item()`) and sizes its results by it."""

    computed_on: ClassVar[list[str]] = []
    """The thread of every call of compute()."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = tt.MetricAccumulator(torch.zeros(4), "sum")

    def update(self, label: int) -> None:
        self.counts.update(torch.nn.functional.one_hot(torch.tensor(label), 4).double())

    def compute(self) -> dict[str, Any]:
        LeadingCounts.computed_on.append(threading.current_thread().name)
        seen = int(self.counts.value.count_nonzero().item())
        return {"leading": self.counts.value[:seen], "seen": seen}


def test_the_batched_part_of_a_window_leaves_custom_computes_to_their_states_copied_apart() -> None:
    """The device transport's split (issue 35.8): its training thread computes only the built-in rules
    (fixed shapes, no host read), the worker computes custom metrics from their states on the host."""
    metrics = {"leading": LeadingCounts(), "range": RangeMetric(), "sum": tt.SumMetric()}
    plan = WindowPlan(metric_leaves(metrics, op="test"), 1)
    slot = WindowExchange(plan.layout, None).new_slot(plan.device)
    for labels in ([0], [0, 1, 1, 2]):  # the custom result's shape changes between windows
        for label in labels:
            metrics["leading"].update(label)
        metrics["range"].update(torch.tensor([1.0, 4.5]))
        metrics["sum"].update(torch.tensor(float(len(labels))))
        torch._foreach_copy_(plan.layout.views(slot.buffers), plan.local_tensors())
        expected = plan.results(*plan.compute(slot.buffers))
        LeadingCounts.computed_on.clear()
        batched = plan.compute(slot.buffers, custom=False)
        assert LeadingCounts.computed_on == []
        states = {key: value.clone() for key, value in plan.custom_states(slot.buffers).items()}
        assert_same(plan.results(*batched, plan.compute_custom(states)), expected)
    assert expected[0] == {"leading": [2.0, 2.0, 1.0], "seen": 3}  # both windows: nothing resets
    assert expected[2] == 5.0


class SeenCounts(tt.Metric):
    """A custom compute() whose tensor results change shape and dtype with the values it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = tt.MetricAccumulator(torch.zeros(4), "sum")

    def update(self, label: int) -> None:
        self.counts.update(torch.nn.functional.one_hot(torch.tensor(label), 4).double())

    def compute(self) -> dict[str, torch.Tensor]:
        seen = int(self.counts.value.count_nonzero().item())
        leading = self.counts.value[:seen]
        return {"leading": leading if seen % 2 else leading.long(), "seen": torch.tensor(seen)}


def test_a_window_reuses_the_placement_of_results_that_look_alike_and_no_other() -> None:
    """Where each result leaf sits in a window's flat tensor is made again only when a result's
    structure, dtype or shape changes; the values after a changed result (the sum, the mean) move
    with it, and every window gives each metric's own compute()."""
    metrics = {"seen": SeenCounts(), "sum": tt.SumMetric(), "mean": tt.WeightedMeanMetric()}
    plan = WindowPlan(metric_leaves(metrics, op="test"), 1)
    slot = WindowExchange(plan.layout, None).new_slot(plan.device)
    placements = []
    for labels in ([0], [], [1], [2], []):  # seen: 1 (float), 1, 2 (int64), 3 (float), 3
        for label in labels:
            metrics["seen"].update(label)
        metrics["sum"].update(torch.tensor(float(len(labels) + 1)))
        metrics["mean"].update(torch.tensor(0.25 * len(labels)), 2.0)
        torch._foreach_copy_(plan.layout.views(slot.buffers), plan.local_tensors())
        flat, placement = plan.compute(slot.buffers)
        expected = [to_python(metric.compute()) for metric in metrics.values()]
        assert_same(plan.results(flat, placement), expected)
        placements.append(placement)
    assert placements[1] is placements[0] and placements[4] is placements[3]
    assert len({id(placement) for placement in placements}) == 3
    assert expected == [{"leading": [1.0, 1.0, 1.0], "seen": 3}, 8.0, 0.15]


def test_sync_and_compute_reads_without_resetting() -> None:
    metric = tt.WeightedMeanMetric()
    metric.update(torch.tensor(3.0), 2.0)
    assert tt.sync_and_compute(metric) == 3.0
    metric.update(torch.tensor(0.0), 1.0)
    assert tt.sync_and_compute(metric) == 2.0


def _sync_and_compute_rank(rank: int, world_size: int) -> dict[str, Any]:
    counter = CollectiveCounter()
    metrics = make_metrics(rank, world_size)
    feed_window(metrics, rank, 1)
    first = tt.sync_and_compute(metrics)
    with counter.counting() as counted:
        again = tt.sync_and_compute(metrics)
    return {"first": first, "again": again, "calls": dict(counted)}


def test_sync_and_compute_is_exact_with_one_collective_on_4_ranks() -> None:
    for outcome in run_ranks(_sync_and_compute_rank, 4, timeout_s=240):
        assert_same(outcome["first"], expected_window(1, 4))
        assert_same(outcome["again"], expected_window(1, 4))
        assert outcome["calls"] == {"all_reduce": 1}


class OffsetCounts(tt.Metric):
    """A custom compute() using a tensor constant that cannot reach the window's device."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = tt.MetricAccumulator(torch.zeros(2), "sum")
        self.offset = torch.ones(2, device="meta")

    def compute(self) -> torch.Tensor:
        return self.counts.value + self.offset


class MisshapenCounts(tt.Metric):
    """A custom compute() that fails on the window's state."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = tt.MetricAccumulator(torch.zeros(2), "sum")

    def compute(self) -> torch.Tensor:
        return self.counts.value + torch.ones(3)


def test_a_custom_compute_that_fails_on_the_window_device_names_the_metric() -> None:
    expected = r"shifted: MisshapenCounts.compute\(\) failed on the window's state on cpu"
    with pytest.raises(RuntimeError, match=expected):
        tt.sync_and_compute({"shifted": MisshapenCounts()})


def test_a_tensor_attribute_that_cannot_reach_the_window_device_names_the_metric() -> None:
    expected = r"offset: OffsetCounts's tensor attributes cannot be copied to cpu, where its compute\(\) runs"
    with pytest.raises(RuntimeError, match=expected):
        tt.sync_and_compute({"offset": OffsetCounts()})
