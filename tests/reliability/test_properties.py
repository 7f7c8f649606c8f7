"""Property: however a stream of updates is split across ranks and windows, the windows collected by
a real `AsyncMetricCollector` on a real 2-rank gloo group add up to what one rank seeing every
update in one window computes.

Hypothesis draws each plan here, in the test process; two long-lived gloo ranks (started once per
module) run it and send their collected windows back, so an example costs a few collections, not
a process start.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("hypothesis")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

from hypothesis import given, settings
from hypothesis import strategies as st

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.collect import AsyncMetricCollector

WORLD_SIZE = 2
BINS = [-2.0, 0.0, 3.0]
# Integers and halves: every sum of them is exact in float64, whatever the order.
VALUES = st.integers(-8, 8).map(lambda n: n / 2)
WEIGHTS = st.integers(0, 4).map(float)


def make_metrics() -> dict[str, tt.Metric]:
    return {
        "sum": tt.SumMetric(),
        "max": tt.MaxMetric(),
        "min": tt.MinMetric(),
        "mean": tt.WeightedMeanMetric(),
        "weight": tt.SumMetric(),
        "hist": tt.HistogramMetric(BINS),
    }


def feed(metrics: dict[str, tt.Metric], values: list[float], weight: float) -> None:
    batch = torch.tensor(values, dtype=torch.float64)
    metrics["sum"].update(batch)
    metrics["max"].update(batch)
    metrics["min"].update(batch)
    metrics["mean"].update(batch, torch.full_like(batch, weight))
    metrics["weight"].update(weight * len(values))
    metrics["hist"].update(batch)


def _serve(rank: int, world_size: int, requests: list[Any], responses: Any) -> None:
    """Run plans until told to stop: each plan is a list of windows, each a list of (rank, values, weight)."""
    metrics = make_metrics()
    collector = AsyncMetricCollector(metrics, timeout_s=30, max_pending=64).bind()
    try:
        while (plan := requests[rank].get()) is not None:
            for window in plan:
                for owner, values, weight in window:
                    if owner == rank:
                        feed(metrics, values, weight)
                collector.schedule_collection()
            responses.put((rank, [collector.collect_results() for _ in plan]))
    finally:
        collector.unbind()


class Ranks:
    """Two gloo ranks serving plans; `run(plan)` returns each rank's collected windows."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(WORLD_SIZE)]
        self._responses = ctx.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            run_ranks(_serve, WORLD_SIZE, self._requests, self._responses, timeout_s=600)
        except BaseException as error:
            self.error = error

    def run(self, plan: list[list[tuple[int, list[float], float]]]) -> list[list[dict[str, Any]]]:
        for queue in self._requests:
            queue.put(plan)
        by_rank = dict(self._responses.get(timeout=120) for _ in range(WORLD_SIZE))
        return [by_rank[rank] for rank in range(WORLD_SIZE)]

    def stop(self) -> None:
        for queue in self._requests:
            queue.put(None)
        self._thread.join(timeout=120)
        assert self.error is None, self.error


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    served = Ranks()
    yield served
    served.stop()


UPDATE = st.tuples(st.integers(0, WORLD_SIZE - 1), st.lists(VALUES, min_size=0, max_size=4), WEIGHTS)
PLANS = st.lists(st.lists(UPDATE, max_size=5), min_size=1, max_size=5)
"""Windows of updates, each update owned by one rank: the split across ranks and windows."""


def _combined(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals across windows, from each window's results (the weighted mean needs its weight)."""
    weight = sum(w["weight"] for w in windows)
    return {
        "sum": sum(w["sum"] for w in windows),
        "max": max(w["max"] for w in windows),
        "min": min(w["min"] for w in windows),
        "mean": sum(w["mean"] * w["weight"] for w in windows if w["weight"] > 0) / weight if weight else None,
        "weight": weight,
        "counts": [sum(c) for c in zip(*(w["hist"]["counts"] for w in windows), strict=True)],
        "hist_sum": sum(w["hist"]["sum"] for w in windows),
        "count": sum(w["hist"]["count"] for w in windows),
    }


def _one_rank(plan: list[list[tuple[int, list[float], float]]]) -> dict[str, Any]:
    """One rank, one window, every update."""
    metrics = make_metrics()
    for window in plan:
        for _, values, weight in window:
            feed(metrics, values, weight)
    tt.sync_metrics(metrics)  # no process group: the local state becomes the value compute() reads
    results = {name: metric.compute() for name, metric in metrics.items()}
    weight = results["weight"].item()
    return {
        "sum": results["sum"].item(),
        "max": results["max"].item(),
        "min": results["min"].item(),
        "mean": results["mean"].item() if weight else None,
        "weight": weight,
        "counts": results["hist"]["counts"].tolist(),
        "hist_sum": results["hist"]["sum"].item(),
        "count": results["hist"]["count"].item(),
    }


@pytest.mark.timeout(600)
@settings(max_examples=10, deadline=None)
@given(plan=PLANS)
def test_splitting_updates_across_ranks_and_windows_gives_the_one_rank_totals(ranks: Ranks, plan) -> None:
    per_rank = ranks.run(plan)
    assert repr(per_rank[0]) == repr(per_rank[1]), "every rank collects the same windows (NaN included)"
    assert len(per_rank[0]) == len(plan)
    actual, expected = _combined(per_rank[0]), _one_rank(plan)
    mean, expected_mean = actual.pop("mean"), expected.pop("mean")
    assert actual == expected
    if expected_mean is None:
        assert mean is None
    else:
        assert math.isclose(mean, expected_mean, rel_tol=1e-12, abs_tol=1e-12)
