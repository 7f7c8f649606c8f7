"""AsyncMetricCollector on a CUDA device: no host sync on the training thread, a side stream that overlaps.

Single process, no process group: the collection is the snapshot, compute and pinned copy on the side
stream (the collectives are covered by the gloo tests, which share every other line of code).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector, to_python

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"


def _metrics() -> dict[str, tt.Metric]:
    return {
        "loss": tt.WeightedMeanMetric(),
        "accuracy": tt.AccuracyMetric(),
        "grad_norm": tt.HistogramMetric(bins=[0.1, 0.5, 1, 2, 5, 10]),
        "tokens": tt.SumMetric(kind="counter"),
        "max": tt.MaxMetric(),
        "min": tt.MinMetric(),
        "confusion": tt.ConfusionMatrixMetric(4),
        "auroc": tt.BinaryAUROCMetric(num_bins=64),
        "per_rank": tt.PerRankMetric(1, 0),
    }


def _batch(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "loss": torch.rand((), generator=gen),
        "tokens": 128 + step,  # a Python int, as data loaders give it
        "logits": torch.randn(32, 4, generator=gen),
        "labels": torch.randint(0, 4, (32,), generator=gen),
        "grad_norm": torch.rand((), generator=gen) * 4,
        "scores": torch.rand(32, generator=gen),
        "binary": torch.randint(0, 2, (32,), generator=gen),
    }


def _to(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {
        key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()
    }


def _update(metrics: dict[str, tt.Metric], batch: dict[str, Any]) -> None:
    metrics["loss"].update(batch["loss"], batch["tokens"])
    metrics["accuracy"].update(batch["logits"], batch["labels"])
    metrics["grad_norm"].update(batch["grad_norm"])
    metrics["tokens"].update(batch["tokens"])
    metrics["max"].update(batch["grad_norm"])
    metrics["min"].update(batch["grad_norm"])
    metrics["confusion"].update(batch["logits"], batch["labels"])
    metrics["auroc"].update(batch["scores"], batch["binary"])
    metrics["per_rank"].update(batch["loss"])


def _expected(steps: range) -> Any:
    """The same updates on CPU metrics, synced (locally) and computed the blocking way."""
    metrics = _metrics()
    for step in steps:
        _update(metrics, _batch(step))
    tt.sync_metrics(metrics)
    return to_python({name: metric.compute() for name, metric in metrics.items()})


def test_update_and_schedule_issue_no_host_sync() -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    batches = [_to(_batch(step), DEVICE) for step in range(8)]
    with AsyncMetricCollector(metrics) as collector:
        # Warm up: the first window allocates the side stream's buffers and pinned host memory.
        for batch in batches[:4]:
            _update(metrics, batch)
        collector.schedule_collection()
        collector.collect_results()
        torch.cuda.synchronize()

        # Any host sync raises now (the setting is process-wide: the worker must not sync either).
        torch.cuda.set_sync_debug_mode("error")
        try:
            for batch in batches[4:]:
                _update(metrics, batch)
            collector.schedule_collection()
            for batch in batches[:2]:  # the next window, while this one is in flight
                _update(metrics, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        results = collector.collect_results()
        collector.schedule_collection()
        following = collector.collect_results()
    _assert_close(results, _expected(range(4, 8)))
    _assert_close(following, _expected(range(2)))


def test_side_stream_overlaps_main_stream_work() -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    batches = [_to(_batch(step), DEVICE) for step in range(4)]
    with AsyncMetricCollector(metrics) as collector:
        for batch in batches:  # warm-up window: allocations happen here, not under the check
            _update(metrics, batch)
        collector.schedule_collection()
        collector.collect_results()
        torch.cuda.synchronize()

        for batch in batches:
            _update(metrics, batch)
        collector.schedule_collection()
        # Long work on the training stream right after scheduling (a spin kernel of about a second).
        main_busy_from, main_busy_until = torch.cuda.Event(), torch.cuda.Event()
        main_busy_from.record()
        torch.cuda._sleep(2_000_000_000)
        main_busy_until.record()
        results = collector.collect_results()
        # The window was reduced, computed and copied to the host while the training stream was
        # still busy: the side stream waited only for the snapshot, not for later training work.
        assert main_busy_from.query()
        assert not main_busy_until.query()
        torch.cuda.synchronize()
    _assert_close(results, _expected(range(4)))


def test_results_are_python_scalars_from_pinned_memory() -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    with AsyncMetricCollector(metrics) as collector:
        _update(metrics, _to(_batch(0), DEVICE))
        collector.schedule_collection()
        results = collector.collect_results()
    leaves = pytree.tree_leaves(results)
    assert leaves and all(type(leaf) in (float, int, bool) for leaf in leaves)
    _assert_close(results, _expected(range(1)))


def _assert_close(actual: Any, expected: Any) -> None:
    """float64 states summed in another order on the device: equal up to rounding."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, equal_nan=True)
