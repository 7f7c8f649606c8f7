"""A small deterministic 2-rank workload the push and tracker exporters' tests share, with the exact
global values it must export, computed without torch."""

from __future__ import annotations

import bisect
from typing import Any

import torch

import torchtelemetry as tt
from torchtelemetry.metric import metric_leaves, sync_metrics
from torchtelemetry.report import flatten_results, to_python

BINS = [0.5, 1.0, 2.0]
STEPS = [10, 20, 30]


def make_metrics(rank: int, world_size: int) -> dict[str, Any]:
    """The metric tree every rank builds."""
    return {
        "train": {"loss": tt.WeightedMeanMetric()},
        "tokens": tt.SumMetric(kind="counter", unit="tokens"),
        "grad_norm": tt.HistogramMetric(bins=BINS),
        "step_time": tt.PerRankMetric(world_size, rank, unit="seconds"),
    }


def _loss_batch(rank: int, window: int) -> tuple[list[float], list[float]]:
    return [float(rank + window), float(rank + window + 1)], [1.0, 3.0]


def _grad_norms(rank: int, window: int) -> list[float]:
    return [0.25 * (rank + 1), 1.5, 3.0 + rank + window]


def update_window(metrics: dict[str, Any], rank: int, window: int) -> None:
    """Rank-dependent updates of one logging window (state accumulates over windows)."""
    values, weights = _loss_batch(rank, window)
    metrics["train"]["loss"].update(torch.tensor(values), torch.tensor(weights))
    metrics["tokens"].update(100 * (rank + 1))
    metrics["grad_norm"].update(torch.tensor(_grad_norms(rank, window)))
    metrics["step_time"].update(0.25 * (rank + 1))


def global_report(metrics: dict[str, Any]) -> dict[str, Any]:
    """Sync across ranks, then the flattened report every rank computes."""
    sync_metrics(metrics)
    leaves = metric_leaves(metrics)
    return flatten_results(leaves, [to_python(metric.compute()) for _, metric in leaves])


def expected_values(world_size: int, windows: int) -> dict[str, Any]:
    """The exact global values after `windows` windows, computed without torch."""
    weighted = total_weight = 0.0
    norms: list[float] = []
    for window in range(windows):
        for rank in range(world_size):
            values, weights = _loss_batch(rank, window)
            weighted += sum(v * w for v, w in zip(values, weights, strict=True))
            total_weight += sum(weights)
            norms += _grad_norms(rank, window)
    counts = [0] * (len(BINS) + 1)
    for norm in norms:
        counts[bisect.bisect_left(BINS, norm)] += 1  # bucket i holds bins[i-1] < v <= bins[i]
    return {
        "train/loss": weighted / total_weight,
        "tokens": float(windows * sum(100 * (rank + 1) for rank in range(world_size))),
        "grad_norm": {"bounds": BINS, "counts": counts, "sum": sum(norms), "count": len(norms)},
        "step_time": {str(rank): 0.25 * (rank + 1) for rank in range(world_size)},
    }
