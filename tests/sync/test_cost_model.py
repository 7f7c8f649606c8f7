"""The window cost model (`window_cost`, docs/scale.md) against what real gloo ranks send.

On 2, 3 and 4 ranks, a window small enough to be gathered and one reduced bucket by bucket: the
collectives counted, the ring steps (gloo's TCP ring writes 6 messages per step, fewer for a
buffer of fewer than 2 x world elements) and the payload bytes each rank wrote to its sockets
(/proc/self/io, less gloo's 48-byte message headers) are those the model predicts from the layout
alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.sync.collectives import CollectiveCounter, Traffic, measure_traffic
from torchtelemetry.collect import AsyncMetricCollector, WindowPlan
from torchtelemetry.metric import metric_leaves
from torchtelemetry.sync import GATHER_LIMIT_BYTES, WindowCost, ring_all_reduce, window_cost
from torchtelemetry.sync._exchange import slot_regions

HAS_IO_ACCOUNTING = os.path.exists("/proc/self/io")

GLOO_WRITES_PER_RING_STEP = 6
_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)


def _small() -> dict[str, Any]:
    return {f"m{i:02d}": _KINDS[i % len(_KINDS)]() for i in range(16)}


def _large() -> dict[str, Any]:
    """A 200-class confusion matrix (320 KB of state): one all-reduce per bucket at any world size."""
    return {"confusion": tt.ConfusionMatrixMetric(200), "worst": tt.MaxMetric(), "best": tt.MinMetric()}


def _feed(metrics: dict[str, Any], rank: int) -> None:
    for name, metric in metrics.items():
        if name == "confusion":
            metric.update(torch.tensor([rank, 3, 199]), torch.tensor([rank, 2, 199]))
        else:
            metric.update(torch.tensor(float(rank + 1)))


TREES: dict[str, Callable[[], dict[str, Any]]] = {"small": _small, "large": _large}


def _traffic_rank(rank: int, world_size: int) -> dict[str, tuple[Traffic, WindowCost]]:
    counter = CollectiveCounter()
    out = {}
    for name, build in TREES.items():
        metrics = build()
        with AsyncMetricCollector(metrics, timeout_s=60) as collector:

            def window(metrics: Any = metrics, collector: AsyncMetricCollector = collector) -> None:
                _feed(metrics, rank)
                collector.schedule_collection()
                collector.collect_results()

            window()  # the first window also checks the layout
            traffic = measure_traffic(counter, window, 4)
        layout = WindowPlan(metric_leaves(metrics, op="test"), world_size).layout
        out[name] = (traffic, window_cost(layout, world_size))
    return out


@pytest.mark.skipif(not HAS_IO_ACCOUNTING, reason="no /proc/self/io here")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_ring_steps_and_bytes_are_what_the_model_predicts(world_size: int) -> None:
    for rank, outcome in enumerate(run_ranks(_traffic_rank, world_size, timeout_s=240)):
        small, small_model = outcome["small"]
        large, large_model = outcome["large"]
        assert small_model.collectives == 1, "16 metrics are gathered in one all-reduce"
        assert large_model.collectives > 1, "the confusion matrix is reduced bucket by bucket"
        for traffic, model in ((small, small_model), (large, large_model)):
            where = f"rank {rank} of {world_size}: measured {traffic}, model {model}"
            assert traffic.collectives == model.collectives, where
            # A buffer of fewer than 2 x world elements (the large tree's MAX bucket) is cut into
            # fewer segments, with fewer messages; never more.
            assert traffic.writes <= GLOO_WRITES_PER_RING_STEP * model.ring_steps, where
            # gloo cuts a buffer into 2 segments per rank, of whole elements: each ring step sends
            # two segments, each at most one element (8 bytes) off the even share.
            assert abs(traffic.payload - model.bytes_sent) <= 16 * model.ring_steps, where
        assert small.writes == GLOO_WRITES_PER_RING_STEP * small_model.ring_steps


# -- the switch: the gather where the model says it is the faster way, within its memory bound -------


def _mixed_layout(count: int, world_size: int, *, signals: bool = True) -> Any:
    """What `Telemetry` collects for a tree of `count` mixed metrics at `world_size` ranks."""
    from torchtelemetry.report import SignalContext, SignalSet, builtin_signals

    metrics: dict[str, Any] = {"tree": {f"m{i:04d}": _KINDS[i % len(_KINDS)]() for i in range(count)}}
    if signals:
        context = SignalContext(world_size, 0, torch.device("cpu"))
        metrics |= SignalSet(builtin_signals(context)).metrics()
    return WindowPlan(metric_leaves(metrics, op="test"), world_size).layout


def _both_ways(layout: Any, world_size: int) -> tuple[WindowCost, WindowCost, int]:
    """(the gather, one all-reduce per bucket, the gather buffer's bytes) for one window."""
    regions, slot_bytes = slot_regions(layout)
    per_bucket = WindowCost(0, 0, 0.0)
    for _, nbytes, _ in regions.values():
        per_bucket += ring_all_reduce(nbytes, world_size)
    return ring_all_reduce(world_size * slot_bytes, world_size), per_bucket, world_size * slot_bytes


@pytest.mark.parametrize("count", [16, 1024])
@pytest.mark.parametrize("world_size", [2, 8, 32, 64, 128, 512, 16384])
def test_each_window_takes_the_way_the_model_says_is_faster(count: int, world_size: int) -> None:
    layout = _mixed_layout(count, world_size)
    gather, per_bucket, buffer_bytes = _both_ways(layout, world_size)
    chosen = window_cost(layout, world_size)
    if buffer_bytes <= GATHER_LIMIT_BYTES:
        assert chosen.seconds() == min(gather.seconds(), per_bucket.seconds())
    else:
        assert chosen == per_bucket
    if world_size >= 512:  # the per-rank values alone make the gather cost more than it saves
        assert chosen == per_bucket and gather.seconds() > per_bucket.seconds()


def test_a_thousand_metrics_on_32_ranks_are_one_collective() -> None:
    """Below the break-even slot (~25 KB), the gather is faster at any world size its buffer allows:
    the old limit (world x slot <= 256 KiB) gave it up here, at 23 ranks."""
    layout = _mixed_layout(1024, 32)
    gather, per_bucket, _ = _both_ways(layout, 32)
    assert gather.seconds() < per_bucket.seconds()
    assert window_cost(layout, 32) == gather


def test_a_large_slot_on_two_ranks_is_reduced_bucket_by_bucket() -> None:
    """A 100-class confusion matrix (80 KB): gathering it would send twice its bytes to save one ring
    step of latency, which the model prices lower (the old limit gathered it)."""
    metrics = {"confusion": tt.ConfusionMatrixMetric(100), "worst": tt.MaxMetric()}
    layout = WindowPlan(metric_leaves(metrics, op="test"), 2).layout
    gather, per_bucket, buffer_bytes = _both_ways(layout, 2)
    assert buffer_bytes <= 256 * 1024 and gather.seconds() > per_bucket.seconds()
    assert window_cost(layout, 2) == per_bucket
