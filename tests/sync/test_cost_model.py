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
from torchtelemetry.sync import GATHER_LIMIT_BYTES, WindowCost, window_cost

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/self/io here")

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_ring_steps_and_bytes_are_what_the_model_predicts(world_size: int) -> None:
    for rank, outcome in enumerate(run_ranks(_traffic_rank, world_size, timeout_s=240)):
        small, small_model = outcome["small"]
        large, large_model = outcome["large"]
        assert small_model.collectives == 1, "16 metrics are gathered in one all-reduce"
        assert large_model.collectives > 1 and world_size * 320_000 > GATHER_LIMIT_BYTES
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
