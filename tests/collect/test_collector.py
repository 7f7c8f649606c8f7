"""AsyncMetricCollector on real gloo ranks: exact windows, ordering, structure, misuse, leaks, groups."""

from __future__ import annotations

import bisect
import math
import random
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.trees import pytree
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.report import to_python

THREAD_PREFIX = "torchtelemetry-collector"
BINS = [0.5, 1.0, 2.0]
NUM_CLASSES = 3
ACCURACY_CLASSES = 4


# -- the metrics and the data every rank feeds them, in plain Python --------------------------


def make_metrics(rank: int, world_size: int) -> dict[str, Any]:
    """Nested dicts and a list, every reduce op, float64 and int64 buckets, vector and dict results."""
    return {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "tokens": tt.SumMetric(kind="counter"),
            "accuracy": tt.AccuracyMetric(num_classes=ACCURACY_CLASSES),
        },
        "grad": {
            "norm_max": tt.MaxMetric(),
            "norm_min": tt.MinMetric(),
            "norm_hist": tt.HistogramMetric(bins=BINS),
        },
        "step_time": tt.PerRankMetric(world_size, rank),
        "confusion": tt.ConfusionMatrixMetric(NUM_CLASSES),
        "events": [tt.SumMetric(dtype=torch.int64)],
    }


def steps_in(rank: int, window: int) -> int:
    """How many updates a rank makes in a window; every 5th window is empty on every rank."""
    return 0 if window % 5 == 3 else 1 + (rank + window) % 3


def batch(rank: int, window: int, step: int) -> dict[str, Any]:
    """One step's inputs as Python numbers; dyadic values keep every float64 sum exact."""
    rng = random.Random(f"{rank}/{window}/{step}")
    size = rng.randint(1, 4)
    return {
        "loss": [rng.randint(-16, 16) / 8 for _ in range(size)],
        "weight": [rng.randint(0, 3) for _ in range(size)],
        "tokens": float(rng.randint(0, 100)),
        "preds": [rng.randrange(ACCURACY_CLASSES) for _ in range(size)],
        "labels": [rng.randrange(ACCURACY_CLASSES) for _ in range(size)],
        "norms": [rng.randint(0, 24) / 8 for _ in range(size)],
        "step_time": rng.randint(1, 16) / 8,
        "cm_preds": [rng.randrange(NUM_CLASSES) for _ in range(size)],
        "cm_labels": [rng.randrange(NUM_CLASSES) for _ in range(size)],
        "events": rng.randint(0, 5),
    }


def update(metrics: dict[str, Any], data: dict[str, Any]) -> None:
    train, grad = metrics["train"], metrics["grad"]
    train["loss"].update(torch.tensor(data["loss"]), torch.tensor(data["weight"], dtype=torch.float32))
    train["tokens"].update(torch.tensor(data["tokens"]))
    train["accuracy"].update(torch.tensor(data["preds"]), torch.tensor(data["labels"]))
    norms = torch.tensor(data["norms"], dtype=torch.float64)
    grad["norm_max"].update(norms)
    grad["norm_min"].update(norms)
    grad["norm_hist"].update(norms)
    metrics["step_time"].update(torch.tensor(data["step_time"]))
    metrics["confusion"].update(torch.tensor(data["cm_preds"]), torch.tensor(data["cm_labels"]))
    metrics["events"][0].update(torch.tensor(data["events"]))


def feed_window(metrics: dict[str, Any], rank: int, window: int) -> None:
    for step in range(steps_in(rank, window)):
        update(metrics, batch(rank, window, step))


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def expected_window(window: int, world_size: int) -> dict[str, Any]:
    """The exact global results of one window, computed without torch."""
    data = [batch(r, window, s) for r in range(world_size) for s in range(steps_in(r, window))]
    weighted = sum(v * w for d in data for v, w in zip(d["loss"], d["weight"], strict=True))
    weight = sum(w for d in data for w in d["weight"])
    hits = sum(p == t for d in data for p, t in zip(d["preds"], d["labels"], strict=True))
    seen = sum(len(d["preds"]) for d in data)
    norms = [n for d in data for n in d["norms"]]
    counts = [0.0] * (len(BINS) + 1)
    for norm in norms:
        counts[bisect.bisect_left(BINS, norm)] += 1
    step_sums, step_counts = [0.0] * world_size, [0.0] * world_size
    for rank in range(world_size):
        for step in range(steps_in(rank, window)):
            step_sums[rank] += batch(rank, window, step)["step_time"]
            step_counts[rank] += 1
    matrix = [[0.0] * NUM_CLASSES for _ in range(NUM_CLASSES)]
    for d in data:
        for pred, label in zip(d["cm_preds"], d["cm_labels"], strict=True):
            matrix[label][pred] += 1
    true_positive = [matrix[c][c] for c in range(NUM_CLASSES)]
    precision = [
        _ratio(true_positive[c], sum(row[c] for row in matrix)) if any(row[c] for row in matrix) else 0.0
        for c in range(NUM_CLASSES)
    ]
    recall = [_ratio(true_positive[c], sum(matrix[c])) if sum(matrix[c]) else 0.0 for c in range(NUM_CLASSES)]
    f1 = [2 * p * r / (p + r) if p + r else 0.0 for p, r in zip(precision, recall, strict=True)]
    # Macro averages over the classes in the targets or the predictions (torchmetrics' macro).
    occurring = max(1, sum(1 for c in range(NUM_CLASSES) if sum(matrix[c]) or any(row[c] for row in matrix)))
    return {
        "train": {
            "loss": _ratio(weighted, weight),
            "tokens": sum(d["tokens"] for d in data) + 0.0,
            "accuracy": _ratio(hits, seen),
        },
        "grad": {
            "norm_max": max(norms, default=-math.inf),
            "norm_min": min(norms, default=math.inf),
            "norm_hist": {
                "bounds": BINS,
                "counts": counts,
                "sum": sum(norms) + 0.0,
                "count": float(len(norms)),
            },
        },
        "step_time": [_ratio(s, c) for s, c in zip(step_sums, step_counts, strict=True)],
        "confusion": {
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "macro_precision": pytest.approx(sum(precision) / occurring, rel=1e-12),
            "macro_recall": pytest.approx(sum(recall) / occurring, rel=1e-12),
            "macro_f1": pytest.approx(sum(f1) / occurring, rel=1e-12),
        },
        "events": [sum(d["events"] for d in data)],
    }


def assert_same(actual: Any, expected: Any, path: str = "results") -> None:
    """Same containers, same keys, Python scalar leaves equal to the expectation (NaN equals NaN)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert actual.keys() == expected.keys(), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: expected a list, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{path}: {actual} != {expected}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{index}]")
    else:
        assert type(actual) in (float, int, bool), f"{path}: {actual!r} is not a Python scalar"
        if isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(actual), f"{path}: {actual} != nan"
        else:
            assert actual == expected, f"{path}: {actual} != {expected}"
            if not isinstance(expected, type(pytest.approx(0))):
                assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"


def collector_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


# -- many windows in a row on real ranks ----------------------------------------------------


def _windows_rank(rank: int, world_size: int, num_windows: int, in_flight: int) -> list[Any]:
    metrics = make_metrics(rank, world_size)
    results = []
    with AsyncMetricCollector(metrics, timeout_s=60, max_pending=in_flight + 1) as collector:
        for window in range(num_windows):
            feed_window(metrics, rank, window)
            collector.schedule_collection()
            # The loop goes on updating the next windows while up to `in_flight` windows are collected.
            if collector.pending > in_flight:
                results.append(collector.collect_results())
        while collector.pending:
            results.append(collector.collect_results())
    return results


@pytest.mark.parametrize(("world_size", "in_flight"), [(2, 1), (2, 3), (4, 2)])
def test_every_window_holds_exactly_its_own_updates(world_size: int, in_flight: int) -> None:
    num_windows = 12
    per_rank = run_ranks(_windows_rank, world_size, num_windows, in_flight, timeout_s=240)
    for rank, results in enumerate(per_rank):
        assert len(results) == num_windows
        for window, result in enumerate(results):
            assert_same(result, expected_window(window, world_size), f"rank {rank} window {window}")


# -- collectives go to the collector's own process group, from its own thread ----------------


def _group_rank(rank: int, world_size: int) -> dict[str, Any]:
    calls: list[tuple[Any, str]] = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs.get("group"), threading.current_thread().name))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        metrics = make_metrics(rank, world_size)
        with AsyncMetricCollector(metrics, max_pending=3) as collector:
            bind_threads = sorted({thread for _, thread in calls})
            calls.clear()  # bind() checked the layout across the ranks, on the collector's group
            for window in range(3):
                feed_window(metrics, rank, window)
                collector.schedule_collection()
                # The training's own collective on the default group, while the window is in flight.
                training = torch.tensor([float(rank)])
                real_all_reduce(training)
            results = [collector.collect_results() for _ in range(3)]
            groups = {id(group): group for group, _ in calls}
            outcome = {
                "results": results,
                "training_sum": training.item(),
                "num_calls": len(calls),
                "groups_are_world": [group is None or group is dist.group.WORLD for group in groups.values()],
                "group_ranks": [
                    dist.get_process_group_ranks(group) for group in groups.values() if group is not None
                ],
                "threads": sorted({thread for _, thread in calls}),
                "bind_threads": bind_threads,
            }
    finally:
        dist.all_reduce = real_all_reduce
    return outcome


def test_collectives_use_a_dedicated_group_on_the_worker_thread() -> None:
    for outcome in run_ranks(_group_rank, 2):
        for window, result in enumerate(outcome["results"]):
            assert_same(result, expected_window(window, 2), f"window {window}")
        assert outcome["num_calls"] == 3  # one collective per window (the layout was checked at bind)
        assert outcome["groups_are_world"] == [False]
        assert outcome["group_ranks"] == [[0, 1]]
        assert len(outcome["threads"]) == 1 and outcome["threads"][0].startswith(THREAD_PREFIX)
        assert outcome["bind_threads"] == ["MainThread"]
        assert outcome["training_sum"] == 1.0


# -- unbind with work in flight, and no leaks ---------------------------------------------


def _leak_rank(rank: int, world_size: int, collections: int) -> dict[str, Any]:
    from torch.distributed.distributed_c10d import _world

    from torchtelemetry.sync._reduce import _VERIFIED_LAYOUTS

    metrics = {"loss": tt.WeightedMeanMetric(), "tokens": tt.SumMetric(kind="counter")}
    groups_before = len(_world.pg_map)
    layouts_before = len(_VERIFIED_LAYOUTS)
    collector = AsyncMetricCollector(metrics, timeout_s=60, max_pending=8).bind()
    threads_while_bound = []
    tokens = []
    for index in range(collections):
        metrics["tokens"].update(torch.tensor(float(rank + index)))
        metrics["loss"].update(torch.tensor(1.0))
        collector.schedule_collection()
        if collector.pending == 8:
            tokens.append(collector.collect_results()["tokens"])
        if index % 100 == 0:
            threads_while_bound.append(len(collector_threads()))
    # Unbind with windows in flight: they are finished (or discarded) cleanly, nothing leaks.
    in_flight = collector.pending
    collector.unbind()
    after_unbind = {"threads": len(collector_threads()), "groups": len(_world.pg_map) - groups_before}
    # Bind and unbind again and again: every cycle gives its thread and group back.
    for _ in range(5):
        collector.bind()
        metrics["tokens"].update(torch.tensor(1.0))
        collector.schedule_collection()
        assert collector.collect_results()["tokens"] == world_size
        collector.unbind()
    return {
        "threads_while_bound": sorted(set(threads_while_bound)),
        "in_flight_at_unbind": in_flight,
        "after_unbind": after_unbind,
        "after_cycles": {"threads": len(collector_threads()), "groups": len(_world.pg_map) - groups_before},
        "remembered_layouts": len(_VERIFIED_LAYOUTS) - layouts_before,
        "tokens": tokens,
    }


def test_no_thread_or_group_leak_after_1000_collections_and_unbind_in_flight() -> None:
    collections = 1000
    for outcome in run_ranks(_leak_rank, 2, collections, timeout_s=240):
        assert outcome["threads_while_bound"] == [1]
        assert outcome["in_flight_at_unbind"] == 7
        assert outcome["after_unbind"] == {"threads": 0, "groups": 0}
        assert outcome["after_cycles"] == {"threads": 0, "groups": 0}
        assert outcome["remembered_layouts"] == 0, "a destroyed group's verified layouts are forgotten"
        # Window i holds rank 0's i and rank 1's i + 1; the first collected is window 0.
        assert outcome["tokens"] == [float(2 * i + 1) for i in range(collections - 7)]


# -- without torch.distributed --------------------------------------------------------------


def test_non_distributed_windows_are_exact_and_in_order() -> None:
    assert not dist.is_initialized()
    metrics = make_metrics(0, 1)
    collector = AsyncMetricCollector(metrics, max_pending=3).bind()
    try:
        results = []
        for window in range(7):
            feed_window(metrics, 0, window)
            collector.schedule_collection()
            if window % 3 == 2:  # several windows in flight at once
                results.extend(collector.collect_results() for _ in range(collector.pending))
        results.extend(collector.collect_results() for _ in range(collector.pending))
    finally:
        collector.unbind()
    assert len(results) == 7
    for window, result in enumerate(results):
        assert_same(result, expected_window(window, 1), f"window {window}")
    assert collector_threads() == []


def test_results_have_the_structure_of_compute() -> None:
    metrics = make_metrics(0, 1)
    feed_window(metrics, 0, 0)
    tt.sync_metrics(metrics)
    computed = pytree.tree_map(lambda metric: metric.compute(), metrics)
    with AsyncMetricCollector(metrics) as collector:
        collector.schedule_collection()
        results = collector.collect_results()
        assert not collector.ready() and collector.pending == 0
    # Same nesting as compute() (vectors become lists), every leaf a Python scalar.
    assert pytree.tree_structure(results) == pytree.tree_structure(to_python(computed))
    leaves = pytree.tree_leaves(results)
    assert leaves and all(type(leaf) in (float, int, bool) for leaf in leaves)
    assert_same(results, to_python(computed))


def test_a_single_metric_gives_its_own_result() -> None:
    metric = tt.SumMetric()
    with AsyncMetricCollector(metric) as collector:
        metric.update(torch.tensor([1.0, 2.0]))
        collector.schedule_collection()
        metric.update(torch.tensor(10.0))  # next window
        collector.schedule_collection()
        assert collector.collect_results() == 3.0
        assert collector.collect_results() == 10.0


def test_ready_turns_true_once_the_window_is_done() -> None:
    metric = tt.SumMetric()
    with AsyncMetricCollector(metric) as collector:
        assert not collector.ready()
        metric.update(torch.tensor(4.0))
        collector.schedule_collection()
        deadline = time.monotonic() + 30
        while not collector.ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.ready()
        assert collector.collect_results() == 4.0


# -- misuse ------------------------------------------------------------------------------


def test_schedule_before_bind_says_to_bind() -> None:
    collector = AsyncMetricCollector(tt.SumMetric())
    with pytest.raises(RuntimeError, match=r"schedule_collection: not bound; call bind\(\) first"):
        collector.schedule_collection()
    with pytest.raises(RuntimeError, match=r"call bind\(\) first"):
        collector.collect_results()
    with pytest.raises(RuntimeError, match=r"call bind\(\) first"):
        collector.ready()


def test_collect_with_nothing_scheduled_says_to_schedule() -> None:
    with AsyncMetricCollector(tt.SumMetric()) as collector:
        with pytest.raises(RuntimeError, match=r"nothing scheduled; call schedule_collection\(\) first"):
            collector.collect_results()
        collector.schedule_collection()
        collector.collect_results()
        with pytest.raises(RuntimeError, match=r"call schedule_collection\(\) first"):
            collector.collect_results()


def test_use_after_unbind_says_to_bind_again() -> None:
    metric = tt.SumMetric()
    collector = AsyncMetricCollector(metric).bind()
    collector.unbind()
    for call in (collector.schedule_collection, collector.collect_results, collector.ready):
        with pytest.raises(RuntimeError, match=r"already unbound; call bind\(\) to use it again"):
            call()
    collector.unbind()  # a second unbind is a no-op
    collector.bind()
    metric.update(torch.tensor(2.0))
    collector.schedule_collection()
    assert collector.collect_results() == 2.0
    collector.unbind()


def test_bind_twice_says_to_unbind_first() -> None:
    with AsyncMetricCollector(tt.SumMetric()) as collector:
        with pytest.raises(RuntimeError, match=r"already bound; call unbind\(\) before binding again"):
            collector.bind()
        collector.schedule_collection()
        collector.collect_results()
        assert len(collector_threads()) == 1


def test_too_many_pending_windows_says_to_collect() -> None:
    with AsyncMetricCollector(tt.SumMetric(), max_pending=2) as collector:
        collector.schedule_collection()
        collector.schedule_collection()
        with pytest.raises(RuntimeError, match=r"2 collections are pending; call collect_results\(\) first"):
            collector.schedule_collection()
        assert collector.pending == 2


def test_a_collector_built_directly_has_the_configs_bounds() -> None:
    """`max_pending` (back-pressure and ring size) and `timeout_s` have one default, not one per owner."""
    collector = AsyncMetricCollector(tt.SumMetric())
    config = tt.TelemetryConfig()
    assert (
        (collector.max_pending, collector.timeout_s) == (config.max_pending, config.timeout_s) == (2, 300.0)
    )
    with collector:
        collector.schedule_collection()
        collector.schedule_collection()
        with pytest.raises(RuntimeError, match="2 collections are pending"):
            collector.schedule_collection()


def test_bad_arguments_name_the_key() -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        AsyncMetricCollector(tt.SumMetric(), timeout_s=0)
    with pytest.raises(ValueError, match="max_pending must be at least 1"):
        AsyncMetricCollector(tt.SumMetric(), max_pending=0)
    with pytest.raises(TypeError, match="expected a Metric"):
        AsyncMetricCollector({"loss": 1.0})


def test_unbind_in_flight_keeps_later_updates_for_the_next_binding() -> None:
    metric = tt.SumMetric()
    collector = AsyncMetricCollector(metric).bind()
    metric.update(torch.tensor(1.0))
    collector.schedule_collection()
    metric.update(torch.tensor(5.0))
    collector.unbind()  # the scheduled window is discarded; the local update after it is not
    assert collector_threads() == []
    with collector:
        collector.schedule_collection()
        assert collector.collect_results() == 5.0


def test_metrics_changed_after_bind_are_picked_up() -> None:
    """A metric created after bind() changes nothing; an accumulator replaced after bind() is read anew."""
    metric = tt.SumMetric()
    with AsyncMetricCollector(metric) as collector:
        metric.update(torch.tensor(1.0))
        collector.schedule_collection()
        tt.MaxMetric()  # registers accumulators elsewhere in the process
        metric.update(torch.tensor(2.0))
        collector.schedule_collection()
        assert [collector.collect_results() for _ in range(2)] == [1.0, 2.0]
        metric.total = tt.MetricAccumulator(0.0, "sum", dtype=torch.float64)  # nothing in flight
        metric.update(torch.tensor(4.0))
        collector.schedule_collection()
        assert collector.collect_results() == 4.0


def test_bind_keeps_values_and_the_local_storage_then_stays_put() -> None:
    metrics = {"loss": tt.WeightedMeanMetric(), "worst": tt.MaxMetric(), "best": tt.MinMetric()}
    metrics["loss"].update(torch.tensor(3.0), 2.0)  # before bind: must land in the first window
    metrics["worst"].update(torch.tensor(-1.0))
    collector = AsyncMetricCollector(metrics).bind()
    pointers = {
        name: [acc.local.data_ptr() for acc in metric.accumulators.values()]
        for name, metric in metrics.items()
    }
    for window in range(3):
        metrics["loss"].update(torch.tensor(1.0), 2.0)
        metrics["best"].update(torch.tensor(float(window)))
        collector.schedule_collection()
        results = collector.collect_results()
        assert results["loss"] == (2.0 if window == 0 else 1.0)
        assert results["worst"] == (-1.0 if window == 0 else -math.inf)
        assert results["best"] == float(window)
    # A CUDA graph captured after bind() replays against these addresses: they never change.
    assert pointers == {
        name: [acc.local.data_ptr() for acc in metric.accumulators.values()]
        for name, metric in metrics.items()
    }
    collector.unbind()


def test_adopt_refuses_storage_of_another_shape_or_dtype() -> None:
    accumulator = tt.MetricAccumulator(torch.zeros(3), "sum", dtype=torch.float64)
    with pytest.raises(ValueError, match=r"storage is torch.float32\(3,\), expected torch.float64\(3,\)"):
        accumulator.adopt(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"expected torch.float64\(3,\)"):
        accumulator.adopt(torch.zeros(4, dtype=torch.float64))


def test_bind_moves_the_metrics_to_the_given_device() -> None:
    metrics = {"loss": tt.WeightedMeanMetric(), "hist": tt.HistogramMetric(bins=[1.0, 2.0])}
    metrics["loss"].update(torch.tensor(2.0), 1.0)
    # "meta": a device without data; the device transport computes there (the host one could not copy out)
    collector = AsyncMetricCollector(metrics, device="meta", transport="device").bind()
    assert all(
        acc.device.type == "meta" for metric in metrics.values() for acc in metric.accumulators.values()
    )
    assert metrics["hist"].bounds.device.type == "meta"
    collector.unbind()
