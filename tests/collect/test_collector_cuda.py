"""AsyncMetricCollector on a CUDA device (`make gpu-check`): no host sync on the training thread, both
transports exact, a side stream that overlaps the training's work.

Every line shared with the CPU path (packing, the exchange, batched compute, results) is covered by the
gloo tests; these cover what only a GPU has: events, pinned copies, the side stream and NCCL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import nccl_world_of_one, run_ranks
from tests.trees import pytree
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.report import to_python

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
TRANSPORTS = ["host", "device"]


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


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_update_and_schedule_issue_no_host_sync(transport: str) -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    batches = [_to(_batch(step), DEVICE) for step in range(8)]
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        assert collector.transport_in_use() == transport
        # A first window before the checks (test_gpu_promises.py checks the first window itself).
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


def test_telemetry_step_issues_no_host_sync() -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    batches = [_to(_batch(step), DEVICE) for step in range(8)]
    telemetry = tt.Telemetry(metrics, every=4)
    try:
        for step, batch in enumerate(batches[:4]):  # warm-up window
            _update(metrics, batch)
            telemetry.step(step, tokens=batch["tokens"])
        telemetry.flush()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step, batch in enumerate(batches[4:], start=4):
                _update(metrics, batch)
                telemetry.step(step, tokens=batch["tokens"])  # schedules at step 7
        finally:
            torch.cuda.set_sync_debug_mode(0)
        telemetry.flush()
        assert telemetry.latest_step == 7
        assert telemetry.latest["loss"] == pytest.approx(_expected(range(4, 8))["loss"], rel=1e-9)
    finally:
        telemetry.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_side_stream_overlaps_a_long_matmul_on_the_main_stream(transport: str) -> None:
    metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
    batches = [_to(_batch(step), DEVICE) for step in range(4)]
    weights = torch.randn(4096, 4096, device=DEVICE)
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        for batch in batches:  # warm-up window: allocations happen here, not under the check
            _update(metrics, batch)
        collector.schedule_collection()
        collector.collect_results()
        torch.cuda.synchronize()

        for batch in batches:
            _update(metrics, batch)
        collector.schedule_collection()
        # Long work on the training stream right after scheduling: a chain of matmuls (~30 TFLOP).
        main_busy_from, main_busy_until = torch.cuda.Event(), torch.cuda.Event()
        main_busy_from.record()
        activations = weights
        for _ in range(250):
            activations = torch.tanh(activations @ weights)
        main_busy_until.record()
        results = collector.collect_results()
        # The window was copied (host transport) or reduced, computed and copied on the side stream
        # (device transport) while the training stream was still busy: it waited only for the
        # snapshot, not for later training work.
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


# -- with process groups --------------------------------------------------------------------


def _shared_gpu_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Both ranks keep their metrics on the one GPU; the host transport reduces over gloo."""
    metrics = {"loss": tt.WeightedMeanMetric(), "worst": tt.MaxMetric(), "best": tt.MinMetric()}
    for metric in metrics.values():
        metric.to(DEVICE)
    results = []
    with AsyncMetricCollector(metrics, timeout_s=60, max_pending=4) as collector:
        in_use = collector.transport_in_use()
        for window in range(4):
            for step in range(2):
                value = torch.tensor(float(rank + window + step) / 4, device=DEVICE)
                metrics["loss"].update(value, torch.tensor(1.0 + rank, device=DEVICE))
                metrics["worst"].update(value)
                metrics["best"].update(value)
            collector.schedule_collection()
        results = [collector.collect_results() for _ in range(4)]
    return {"in_use": in_use, "results": results}


def test_host_transport_with_two_ranks_sharing_one_gpu_over_gloo() -> None:
    for outcome in run_ranks(_shared_gpu_rank, 2, timeout_s=240):
        assert outcome["in_use"] == "host"
        for window, result in enumerate(outcome["results"]):
            values = {r: [(r + window + s) / 4 for s in range(2)] for r in range(2)}
            weighted = sum(v * (1 + r) for r, vs in values.items() for v in vs)
            every = [v for vs in values.values() for v in vs]
            assert result == {"loss": weighted / 6, "worst": max(every), "best": min(every)}


def test_device_transport_at_world_size_one_with_nccl() -> None:
    with nccl_world_of_one():
        metrics = {name: metric.to(DEVICE) for name, metric in _metrics().items()}
        groups_before = dist.get_pg_count()
        with AsyncMetricCollector(metrics, transport="device", max_pending=3) as collector:
            assert dist.get_pg_count() == groups_before  # no group created: the training's own one
            windows = [range(0, 3), range(3, 5), range(5, 9)]
            for steps in windows:
                for step in steps:
                    _update(metrics, _to(_batch(step), DEVICE))
                collector.schedule_collection(step=steps[-1])
            results = [collector.collect_results() for _ in windows]
    for steps, result in zip(windows, results, strict=True):
        _assert_close(result, _expected(steps))


def _assert_close(actual: Any, expected: Any) -> None:
    """float64 states summed in another order on the device: equal up to rounding."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, equal_nan=True)
