"""Collections that cannot complete fail with a clear error within the timeout, on every rank."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.collect import AsyncMetricCollector, CollectionError
from torchtelemetry.sync import LayoutMismatchError

TIMEOUT_S = 3.0
# Generous bound for "returned instead of hanging" on a slow, shared CI machine: not a speed check.
NOT_A_HANG_S = TIMEOUT_S + 60


def _collect_outcome(collector: AsyncMetricCollector) -> dict[str, Any]:
    """What `collect_results()` raised, and after how long (`{"type": None}` if it returned)."""
    started = time.monotonic()
    try:
        collector.collect_results()
    except CollectionError as error:
        return {
            "type": type(error).__name__,
            "is_runtime_error": isinstance(error, RuntimeError),
            "message": str(error),
            "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
            "elapsed_s": time.monotonic() - started,
        }
    return {"type": None}


def _never_scheduled_rank(rank: int, world_size: int) -> dict[str, Any] | None:
    metric = tt.SumMetric()
    collector = AsyncMetricCollector(metric, timeout_s=TIMEOUT_S).bind()
    outcome = None
    if rank == 0:
        metric.update(torch.tensor(1.0))
        collector.schedule_collection()
        outcome = _collect_outcome(collector)
    # Rank 1 never schedules: it stays alive (waiting on the training's group) until rank 0 gave up.
    dist.barrier()
    collector.unbind()
    return outcome


def test_a_rank_that_never_schedules_gives_a_collection_error_not_a_hang() -> None:
    outcome, _ = run_ranks(_never_scheduled_rank, 2, timeout_s=120)
    assert outcome is not None, "collect_results returned although rank 1 never scheduled"
    assert outcome["type"] == "CollectionError" and outcome["is_runtime_error"]
    assert "collect_results: window 0" in outcome["message"]
    assert "schedule_collection()" in outcome["message"]
    assert outcome["elapsed_s"] < NOT_A_HANG_S


def _mismatch_rank(rank: int, world_size: int) -> dict[str, Any]:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    if rank == 1:
        metrics["extra"] = tt.MaxMetric()
    started = time.monotonic()
    try:
        AsyncMetricCollector(metrics, timeout_s=TIMEOUT_S).bind()
    except LayoutMismatchError as error:  # at bind(), which may block, not in a window
        return {"message": str(error), "elapsed_s": time.monotonic() - started}
    return {"message": None}


def test_ranks_with_different_metric_sets_fail_at_bind_with_a_layout_mismatch_on_every_rank() -> None:
    for rank, outcome in enumerate(run_ranks(_mismatch_rank, 2, timeout_s=120)):
        assert outcome["message"] is not None, f"rank {rank}: bind() accepted different metric sets"
        assert "ranks hold different metric sets" in outcome["message"]
        assert "extra.extremum" in outcome["message"]
        assert outcome["elapsed_s"] < NOT_A_HANG_S


# -- a rank killed mid-run -------------------------------------------------------------------


def _victim_rank(rank: int, world_size: int) -> dict[str, Any]:
    metric = tt.SumMetric()
    collector = AsyncMetricCollector(metric, timeout_s=TIMEOUT_S).bind()
    metric.update(torch.tensor(float(rank + 1)))
    collector.schedule_collection()
    first = collector.collect_results()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run, as a crashed or OOM-killed rank would
    metric.update(torch.tensor(1.0))
    collector.schedule_collection()
    outcome = _collect_outcome(collector)
    collector.unbind(timeout_s=TIMEOUT_S)
    outcome["first"] = first
    return outcome


def test_a_killed_rank_gives_the_others_a_clear_error_within_the_timeout() -> None:
    outcome = run_ranks(_victim_rank, 2, victim=1, timeout_s=120)[0]
    assert outcome["first"] == 3.0  # both ranks' first window, before the kill
    assert outcome["type"] == "CollectionError", outcome
    assert "window 1" in outcome["message"]
    assert "process group (ranks [0, 1]) failed: a rank may have died" in outcome["message"]
    assert outcome["cause"] == "RuntimeError"  # gloo's own error, kept as the cause
    assert outcome["elapsed_s"] < NOT_A_HANG_S
