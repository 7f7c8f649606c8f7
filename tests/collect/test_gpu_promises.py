"""The GPU path's promises, each checked where a CUDA device exists (`make gpu-check`).

- `schedule_collection()` and `Telemetry.step()` return while the training stream is still busy
  (a long `torch.cuda._sleep` queued before them is still running afterwards): no host sync, the
  first window included.
- Windows under an NCCL world of one with both transports: no host sync seen by
  `torch.cuda.set_sync_debug_mode("error")` nor by `tests.hostsync.NoHostSync`, and every
  collective on an NCCL group issued by the training thread.
- The worker thread works on the metrics' device, and sleeps (not spins) while it waits.
- A custom metric's first window is right on CUDA with the host transport.
- A timed-out `unbind()` never lets the allocator hand out memory the side stream still writes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import nccl_world_of_one, run_ranks
from tests.hostsync import NoHostSync
from tests.sync.collectives import CollectiveRecorder
from torchtelemetry.collect import AsyncMetricCollector

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRANSPORTS = ["host", "device"]
THREAD_PREFIX = "torchtelemetry-collector"


def _metrics(device: str | torch.device = "cuda") -> dict[str, tt.Metric]:
    metrics = {
        "loss": tt.WeightedMeanMetric(),
        "confusion": tt.ConfusionMatrixMetric(8),
        "grad_norm": tt.HistogramMetric(bins=[0.5, 1, 2]),
        "worst": tt.MaxMetric(),
        "best": tt.MinMetric(),
    }
    return {name: metric.to(device) for name, metric in metrics.items()}


def _update(metrics: dict[str, tt.Metric], step: int) -> None:
    device = metrics["loss"].device
    value = torch.full((), 0.25 * step, device=device)
    metrics["loss"].update(value, 512)
    labels = torch.arange(16, device=device) % 8
    metrics["confusion"].update(labels, labels)
    metrics["grad_norm"].update(value)
    metrics["worst"].update(value)
    metrics["best"].update(value)


_CYCLES_PER_SECOND: list[float] = []


def _keep_the_stream_busy(seconds: float) -> None:
    """Queue `torch.cuda._sleep` for about `seconds` on the current stream (calibrated once)."""
    if not _CYCLES_PER_SECOND:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(100_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_SECOND.append(100_000_000 / (start.elapsed_time(end) / 1000))
    torch.cuda._sleep(int(_CYCLES_PER_SECOND[0] * seconds))


# -- nothing waits for the training stream ---------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_schedule_returns_while_the_training_stream_is_busy_from_the_first_window(transport: str) -> None:
    metrics = _metrics()
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        torch.cuda.synchronize()
        for window in range(3):  # the first window too: bind() did everything that blocks
            _update(metrics, window)
            _keep_the_stream_busy(2.0)
            collector.schedule_collection()
            busy = not torch.cuda.current_stream().query()
            results = collector.collect_results()
            assert busy, f"window {window}: schedule_collection() waited for the training stream"
            assert results["worst"] == results["best"] == 0.25 * window


def test_telemetry_step_returns_while_the_training_stream_is_busy() -> None:
    metrics = _metrics()
    telemetry = tt.Telemetry(metrics, every=2)
    try:
        torch.cuda.synchronize()
        for step in range(6):
            _update(metrics, step)
            _keep_the_stream_busy(1.0)
            telemetry.step(step, tokens=torch.tensor(512, device="cuda"), learning_rate=0.1)
            assert not torch.cuda.current_stream().query(), f"step({step}) waited for the training stream"
        telemetry.flush()
        assert telemetry.latest["worst"] == 1.25
    finally:
        telemetry.close()


# -- checked windows under NCCL ------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_windows_under_nccl_sync_nothing_and_issue_nccl_only_from_the_training_thread(transport: str) -> None:
    with nccl_world_of_one(), CollectiveRecorder() as calls:
        metrics = _metrics()
        with AsyncMetricCollector(metrics, transport=transport, max_pending=3) as collector:  # type: ignore[arg-type]
            assert collector.transport_in_use() == transport
            _update(metrics, 0)
            collector.schedule_collection()
            collector.collect_results()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # process-wide: the worker must not sync either
            try:
                with NoHostSync():  # this thread: every host read of a value
                    for window in range(1, 4):
                        _update(metrics, window)
                        collector.schedule_collection()
                        _update(metrics, window)  # the next window, while this one is in flight
            finally:
                torch.cuda.set_sync_debug_mode(0)
            results = [collector.collect_results() for _ in range(3)]
    # Window w holds update(w) and the second update(w - 1), which landed after w - 1 was scheduled.
    assert [r["worst"] for r in results] == [0.25, 0.5, 0.75]
    assert [r["best"] for r in results] == [0.25, 0.25, 0.5]
    nccl = [call for call in calls if "nccl" in call.backend]
    assert nccl, "no collective ran on the NCCL group"
    assert {call.thread for call in nccl} == {"MainThread"}, nccl


def test_telemetry_issues_nccl_collectives_only_from_the_training_thread() -> None:
    with nccl_world_of_one(), CollectiveRecorder() as calls:
        metrics = _metrics()
        telemetry = tt.Telemetry(metrics, every=2)
        for step in range(8):
            _update(metrics, step)
            telemetry.step(step)
        telemetry.close()
    assert any("nccl" in call.backend for call in calls)
    for call in calls:
        assert call.thread == "MainThread" or call.backend == "gloo", call


# -- the worker thread ---------------------------------------------------------------------------


def _worker_device_rank(rank: int, world_size: int) -> dict[str, Any]:
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)  # this process never uses GPU 0 itself
    metric = tt.SumMetric().to(f"cuda:{last}")
    with AsyncMetricCollector(metric) as collector:
        metric.update(torch.ones((), device=f"cuda:{last}"))
        collector.schedule_collection(then=lambda results: (torch.cuda.current_device(), results))
        worker_device, results = collector.collect_results()
    return {
        "worker_device": worker_device,
        "results": results,
        "context_on_gpu0": bool(torch._C._cuda_hasPrimaryContext(0)),
        "last": last,
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_worker_thread_uses_the_metrics_device_and_creates_no_context_on_gpu_0() -> None:
    (outcome,) = run_ranks(_worker_device_rank, 1)
    assert outcome["worker_device"] == outcome["last"]
    assert outcome["results"] == [1.0]
    assert not outcome["context_on_gpu0"]


def test_the_worker_sleeps_while_it_waits_for_the_device() -> None:
    metrics = _metrics()
    with AsyncMetricCollector(metrics, transport="host") as collector:
        worker = next(t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
        clock = time.pthread_getcpuclockid(worker.ident)  # type: ignore[arg-type]
        _update(metrics, 0)
        _keep_the_stream_busy(2.0)
        collector.schedule_collection()
        cpu_before, wall_before = time.clock_gettime(clock), time.monotonic()
        collector.collect_results()
        cpu, wall = time.clock_gettime(clock) - cpu_before, time.monotonic() - wall_before
    assert wall > 1.0, "the window did not wait for the busy stream"
    assert cpu < 0.25 * wall, f"the worker spent {cpu:.2f} s of CPU in a {wall:.2f} s wait (spinning)"


# -- custom metrics, and memory a side stream still writes ----------------------------------------


class ScaledHistogram(tt.HistogramMetric):
    """A subclass with its own compute() reading a tensor attribute (bounds) that `to()` moved."""

    def compute(self) -> dict[str, torch.Tensor]:
        results = super().compute()
        results["bounds"] = self.bounds * 2
        return results


def test_a_custom_metric_on_cuda_gets_a_right_first_window_through_the_host() -> None:
    metric = ScaledHistogram(bins=[1.0, 2.0]).to("cuda")
    with AsyncMetricCollector({"h": metric}, transport="host") as collector:
        metric.update(torch.tensor([0.5, 1.5, 9.0], device="cuda"))
        collector.schedule_collection()
        result = collector.collect_results()["h"]
    assert result == {"bounds": [2.0, 4.0], "counts": [1.0, 1.0, 1.0], "sum": 11.0, "count": 3.0}


def test_a_timed_out_unbind_never_hands_out_memory_the_side_stream_still_writes() -> None:
    metrics = {"best": tt.MinMetric().to("cuda"), "big": tt.ConfusionMatrixMetric(600).to("cuda")}
    collector = AsyncMetricCollector(metrics, transport="device").bind()
    slot_bytes = collector._transport._slots[0].data.numel()  # type: ignore[union-attr]
    metrics["best"].update(torch.ones((), device="cuda"))
    _keep_the_stream_busy(2.0)
    collector.schedule_collection()  # the side stream waits for the busy stream, then negates MIN in place
    collector.unbind(timeout_s=0.01)  # gives up: the slots go back to the allocator
    fresh = [torch.full((slot_bytes,), 7, dtype=torch.uint8, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    assert all(bool((tensor == 7).all()) for tensor in fresh)
