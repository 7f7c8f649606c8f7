"""Transports, one collective per window, and steps riding in the payload, on real gloo ranks."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.collect.test_collector import assert_same, expected_window, feed_window, make_metrics
from tests.distributed import run_ranks
from tests.sync.collectives import CollectiveCounter, CollectiveRecorder
from tests.trees import pytree
from torchtelemetry.collect import (
    HOST_TRANSPORT_LIMIT_BYTES,
    AsyncMetricCollector,
    CollectionError,
    WindowPlan,
)
from torchtelemetry.collect._transports import (
    NCCL_BLOCKING_WAIT_VARIABLES,
    choose_transport,
    nccl_blocking_wait,
)
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import to_python
from torchtelemetry.sync import window_cost


def _blocking_results(metrics: Any) -> Any:
    """The results the blocking path gives: `sync_metrics` then each metric's `compute()`."""
    tt.sync_metrics(metrics)
    return to_python(pytree.tree_map(lambda metric: metric.compute(), metrics))


# -- one collective per window for any op mix while small; one per bucket above ------------------


def _large_metrics(rank: int) -> dict[str, tt.Metric]:
    """A confusion matrix big enough that gathering it costs more than one all-reduce per bucket."""
    metrics = {"confusion": tt.ConfusionMatrixMetric(200), "worst": tt.MaxMetric(), "best": tt.MinMetric()}
    gen = torch.Generator().manual_seed(rank)
    metrics["confusion"].update(
        torch.randint(0, 200, (64,), generator=gen), torch.randint(0, 200, (64,), generator=gen)
    )
    metrics["worst"].update(torch.tensor([float(rank), -3.0]))
    metrics["best"].update(torch.tensor([float(rank), 7.0]))
    return metrics


def _collective_count_rank(rank: int, world_size: int) -> dict[str, Any]:
    counter = CollectiveCounter()
    metrics = make_metrics(rank, world_size)  # 3 buckets: float64 SUM, float64 MAX (MIN folded), int64 SUM
    windows, calls = [], []
    with AsyncMetricCollector(metrics, timeout_s=60) as collector:
        for window in range(4):
            feed_window(metrics, rank, window)
            with counter.counting() as counted:
                collector.schedule_collection()
                windows.append(collector.collect_results())
            calls.append(dict(counted))
    feed_window(metrics, rank, 0)
    tt.sync_and_compute(metrics)  # first use of this layout on the world group: the layout check
    with counter.counting() as counted:
        blocking = tt.sync_and_compute(metrics)
    blocking_calls = dict(counted)

    large = _large_metrics(rank)
    expected_large = _blocking_results(large)
    with AsyncMetricCollector(large, timeout_s=60) as collector:
        collector.schedule_collection()
        collector.collect_results()
        refill = _large_metrics(rank)
        for name, metric in large.items():
            metric.load_state_dict(refill[name].state_dict())
        with counter.counting() as counted:
            collector.schedule_collection()
            large_result = collector.collect_results()
        large_calls = dict(counted)
    return {
        "windows": windows,
        "calls": calls,
        "blocking": blocking,
        "blocking_calls": blocking_calls,
        "large": large_result,
        "expected_large": expected_large,
        "large_calls": large_calls,
    }


def test_a_mixed_window_is_one_collective_while_small_and_one_per_bucket_above() -> None:
    large = WindowPlan(metric_leaves(_large_metrics(0), op="test"), 2).layout
    assert window_cost(large, 2).collectives == 2  # SUM and MAX buckets (docs/scale.md)
    for rank, outcome in enumerate(run_ranks(_collective_count_rank, 2, timeout_s=240)):
        for window, result in enumerate(outcome["windows"]):
            assert_same(result, expected_window(window, 2), f"rank {rank} window {window}")
        # bind() checked that the ranks agree on the layout: every window is one all-reduce.
        assert outcome["calls"] == [{"all_reduce": 1}] * 4
        assert_same(outcome["blocking"], expected_window(0, 2))
        assert outcome["blocking_calls"] == {"all_reduce": 1}
        assert_same(outcome["large"], outcome["expected_large"])
        assert outcome["large_calls"] == {"all_reduce": 2}  # SUM and MAX buckets, in place


# -- the device transport: the training thread issues the collective on the training's group -----


def _device_transport_rank(rank: int, world_size: int) -> dict[str, Any]:
    groups_before = dist.get_pg_count()
    metrics = make_metrics(rank, world_size)
    results = []
    with (
        CollectiveRecorder() as calls,
        AsyncMetricCollector(metrics, transport="device", timeout_s=60, max_pending=3) as collector,
    ):
        groups_while_bound = dist.get_pg_count() - groups_before
        for window in range(5):
            feed_window(metrics, rank, window)
            collector.schedule_collection()
            if collector.pending > 2:  # windows in flight while the next ones are scheduled
                results.append(collector.collect_results())
        results.extend(collector.collect_results() for _ in range(collector.pending))
        in_use = collector.transport_in_use()
    return {
        "results": results,
        "in_use": in_use,
        "groups_while_bound": groups_while_bound,
        "threads": sorted({call.thread for call in calls}),
        "names": sorted({call.name for call in calls}),
        "on_the_training_group": all(call.group in (None, dist.group.WORLD) for call in calls),
        "num_calls": len(calls),
    }


def test_device_transport_issues_on_the_training_thread_and_group() -> None:
    for rank, outcome in enumerate(run_ranks(_device_transport_rank, 2, timeout_s=240)):
        assert outcome["in_use"] == "device"
        for window, result in enumerate(outcome["results"]):
            assert_same(result, expected_window(window, 2), f"rank {rank} window {window}")
        assert outcome["threads"] == ["MainThread"]  # every collective, the layout check at bind included
        assert outcome["on_the_training_group"] and outcome["groups_while_bound"] == 0
        assert outcome["names"] == ["all_reduce"]
        assert outcome["num_calls"] == 1 + 5  # the layout check at bind, then one collective per window


# -- each rank's step rides in the payload -----------------------------------------------------


def _step_rank(rank: int, world_size: int) -> dict[str, Any]:
    metric = tt.SumMetric()
    outcomes = []
    with AsyncMetricCollector(metric, timeout_s=30) as collector:
        for step in (10, 20 + rank, 30):
            metric.update(torch.tensor(1.0))
            collector.schedule_collection(step=step)
            try:
                outcomes.append(collector.collect_results())
            except CollectionError as error:
                outcomes.append(str(error))
    return {"outcomes": outcomes}


def _skipping_telemetry_rank(rank: int, world_size: int) -> dict[str, Any]:
    metrics = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, every=2, timeout_s=30)
    # Rank 1 skips step 1: its windows end at steps 2 and 4, rank 0's at 1 and 3. The failed window
    # surfaces from whichever call collects it first: a later step() or the flush.
    try:
        for step in (0, 1, 2, 3) if rank == 0 else (0, 2, 3, 4):
            metrics["loss"].update(torch.tensor(1.0))
            telemetry.step(step)
        telemetry.flush()
        error = None
    except CollectionError as raised:
        error = str(raised)
    telemetry.close()
    return {"error": error}


def test_ranks_whose_windows_end_at_different_steps_raise_naming_the_steps() -> None:
    for outcome in run_ranks(_step_rank, 2, timeout_s=120):
        first, mismatch, last = outcome["outcomes"]
        assert first == 2.0 and last == 2.0  # aligned windows before and after are unaffected
        assert isinstance(mismatch, str) and "window 1 failed" in mismatch
        assert "rank 0 at step 20, rank 1 at step 21" in mismatch


def test_a_rank_that_skips_a_telemetry_step_makes_every_rank_raise() -> None:
    for rank, outcome in enumerate(run_ranks(_skipping_telemetry_rank, 2, timeout_s=120)):
        assert outcome["error"] is not None, f"rank {rank} mixed windows of different steps silently"
        assert "rank 0 at step 1, rank 1 at step 2" in outcome["error"]


# -- without torch.distributed -----------------------------------------------------------------


@pytest.mark.parametrize("transport", ["host", "device", "auto"])
def test_every_transport_gives_exact_windows_locally(transport: str) -> None:
    metrics = make_metrics(0, 1)
    with AsyncMetricCollector(metrics, transport=transport, max_pending=3) as collector:  # type: ignore[arg-type]
        assert collector.transport_in_use() == ("device" if transport == "device" else "host")
        results = []
        for window in range(7):  # the ring of 3 slots is reused
            feed_window(metrics, 0, window)
            collector.schedule_collection()
            if collector.pending == 3:
                results.append(collector.collect_results())
        results.extend(collector.collect_results() for _ in range(collector.pending))
    for window, result in enumerate(results):
        assert_same(result, expected_window(window, 1), f"window {window}")


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="transport must be 'host', 'device' or 'auto', got 'nccl'"):
        AsyncMetricCollector(tt.SumMetric(), transport="nccl")  # type: ignore[arg-type]


# -- NCCL's blocking wait (issue 35.6) -----------------------------------------------------------

LARGE = HOST_TRANSPORT_LIMIT_BYTES + 8


@pytest.fixture
def blocking_wait(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in NCCL_BLOCKING_WAIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    return monkeypatch


def test_auto_sends_a_large_cuda_window_through_the_host_under_nccl_blocking_wait(
    blocking_wait: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under blocking wait, the device transport's Work.wait() would hold the training thread until the
    window's collective completes, every window: "auto" takes the host transport, and says why."""
    with caplog.at_level(logging.WARNING, logger="torchtelemetry.collect._transports"):
        assert choose_transport("auto", device_type="cuda", packed_bytes=LARGE, backend="nccl") == "host"
    assert "TORCH_NCCL_BLOCKING_WAIT=1" in caplog.text and "host transport" in caplog.text
    blocking_wait.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")
    assert choose_transport("auto", device_type="cuda", packed_bytes=LARGE, backend="nccl") == "device"


def test_the_device_transport_is_refused_under_nccl_blocking_wait(blocking_wait: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"transport='device' under TORCH_NCCL_BLOCKING_WAIT=1 would block"):
        choose_transport("device", device_type="cuda", packed_bytes=LARGE, backend="nccl")
    blocking_wait.delenv("TORCH_NCCL_BLOCKING_WAIT")
    blocking_wait.setenv("NCCL_BLOCKING_WAIT", "true")  # the older name, still read by ProcessGroupNCCL
    with pytest.raises(ValueError, match=r"under NCCL_BLOCKING_WAIT=true"):
        choose_transport("device", device_type="cuda", packed_bytes=LARGE, backend="nccl")
    blocking_wait.setenv("TORCH_NCCL_BLOCKING_WAIT", "0")  # the newer name wins, as in c10d
    assert choose_transport("device", device_type="cuda", packed_bytes=LARGE, backend="nccl") == "device"


def test_blocking_wait_changes_nothing_but_nccl_windows_on_cuda(blocking_wait: pytest.MonkeyPatch) -> None:
    assert nccl_blocking_wait()
    assert choose_transport("device", device_type="cpu", packed_bytes=LARGE, backend="gloo") == "device"
    assert choose_transport("device", device_type="cuda", packed_bytes=LARGE, backend=None) == "device"
    with AsyncMetricCollector(tt.SumMetric(), transport="device") as collector:
        collector.schedule_collection()
        assert collector.collect_results() == 0.0
