"""The GPU path's promises, each checked where a CUDA device exists (`make gpu-check`), on ONE GPU.

Each test names the fix it holds (issue 35) and fails with that fix reverted:

- `schedule_collection()` and `Telemetry.step()` return while the training stream is still busy
  (a long `torch.cuda._sleep` queued before them is still running afterwards): no host sync.
- The first window of a collector bound to a real NCCL group, under the sync checks: the layout
  check and every allocation happened at `bind()` (35.3), the histogram bounds reached the
  window's compute device there too (35.5).
- Every collective on an NCCL group issued by the training thread.
- The worker thread works on the metrics' device (35.1) and sleeps, not spins, while it waits,
  with either transport (35.2); the side stream has a high priority (35.5).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import nccl_world_of_one, run_ranks
from tests.gpu import busy_for, collector_worker, thread_cpu_clock
from tests.hostsync import NoHostSync
from tests.step_inputs import step_inputs
from tests.sync.collectives import CollectiveRecorder
from torchtelemetry.collect import AsyncMetricCollector

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRANSPORTS = ["host", "device"]


def _metrics(prefix: str = "", device: str | torch.device = "cuda") -> dict[str, tt.Metric]:
    """`prefix` makes the layout new to the group (the layout check runs once per group and layout)."""
    metrics = {
        f"{prefix}loss": tt.WeightedMeanMetric(),
        f"{prefix}confusion": tt.ConfusionMatrixMetric(8),
        f"{prefix}grad_norm": tt.HistogramMetric(bins=[0.5, 1, 2]),
        f"{prefix}worst": tt.MaxMetric(),
        f"{prefix}best": tt.MinMetric(),
    }
    return {name: metric.to(device) for name, metric in metrics.items()}


def _update(metrics: dict[str, tt.Metric], step: int) -> None:
    device = next(iter(metrics.values())).device
    value = torch.full((), 0.25 * step, device=device)
    labels = torch.arange(16, device=device) % 8
    for name, metric in metrics.items():
        if name.endswith("loss"):
            metric.update(value, 512)
        elif name.endswith("confusion"):
            metric.update(labels, labels)
        else:
            metric.update(value)


# -- nothing waits for the training stream ---------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_first_window_on_an_nccl_group_syncs_nothing_and_leaves_the_stream_busy(transport: str) -> None:
    """35.3 and 35.5. With the layout check moved back into the first window, the device transport's
    first `schedule_collection()` runs the check's collective and reads its probe on this thread
    (NoHostSync and the sync debug mode raise, and it waits for the busy stream); with the histogram
    bounds copied to the host in a window (not at bind), the host transport's worker copies them
    device-to-host under the process-wide sync debug mode, which fails the window."""
    with nccl_world_of_one():
        metrics = _metrics(prefix=f"first_window/{transport}/")
        with AsyncMetricCollector(metrics, transport=transport, max_pending=3) as collector:  # type: ignore[arg-type]
            assert collector.transport_in_use() == transport
            busy_for(0.01)  # calibrated before the checks
            torch.cuda.synchronize()
            busy = []
            slept = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.set_sync_debug_mode("error")  # process-wide: the worker must not sync either
            try:
                with NoHostSync():  # this thread: every host read of a value
                    for window in range(3):  # the first window first
                        _update(metrics, window)
                        if window == 0:
                            slept[0].record()
                        busy_for(2.0 if window == 0 else 0.2)
                        if window == 0:
                            slept[1].record()
                        started = time.perf_counter()
                        collector.schedule_collection()
                        busy.append(not torch.cuda.current_stream().query())
                        if window == 0:
                            scheduled_s = time.perf_counter() - started
                results = [collector.collect_results() for _ in range(3)]
            finally:
                torch.cuda.set_sync_debug_mode(0)
    sleep_s = slept[0].elapsed_time(slept[1]) / 1000
    assert busy[0], (
        f"the first schedule_collection() waited for the training stream: it took {scheduled_s:.3f} s "
        f"with {sleep_s:.3f} s of GPU work queued"
    )
    for window, result in enumerate(results):
        expected = _metrics(prefix=f"first_window/{transport}/", device="cpu")
        _update(expected, window)
        assert result == tt.sync_and_compute(expected), f"window {window}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_schedule_returns_while_the_training_stream_is_busy(transport: str) -> None:
    metrics = _metrics()
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        torch.cuda.synchronize()
        for window in range(3):
            _update(metrics, window)
            busy_for(1.0)
            collector.schedule_collection()
            busy = not torch.cuda.current_stream().query()
            results = collector.collect_results()
            assert busy, f"window {window}: schedule_collection() waited for the training stream"
            assert results["worst"] == results["best"] == 0.25 * window


def test_telemetry_step_returns_while_the_training_stream_is_busy() -> None:
    metrics = _metrics()
    telemetry = tt.Telemetry(metrics, every=2)
    # Made before the stream is busy: torch.tensor(..., device="cuda") copies from pageable memory and
    # waits for the stream, which failed this test on its first GPU run (an H200) at step 0.
    tokens = torch.tensor(512, device="cuda")
    try:
        torch.cuda.synchronize()
        for step in range(6):
            _update(metrics, step)
            busy_for(1.0)
            telemetry.step(step, **step_inputs(tokens=tokens, learning_rate=0.1))
            assert not torch.cuda.current_stream().query(), f"step({step}) waited for the training stream"
        telemetry.flush()
        assert telemetry.latest["worst"] == 1.25
    finally:
        telemetry.close()


# -- collectives under NCCL ----------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_windows_under_nccl_issue_nccl_only_from_the_training_thread(transport: str) -> None:
    with nccl_world_of_one(), CollectiveRecorder() as calls:
        metrics = _metrics()
        with AsyncMetricCollector(metrics, transport=transport, max_pending=3) as collector:  # type: ignore[arg-type]
            for window in range(3):
                _update(metrics, window)
                collector.schedule_collection()
                _update(metrics, window)  # the next window, while this one is in flight
            results = [collector.collect_results() for _ in range(3)]
    # Window w holds update(w) and the second update(w - 1), which landed after w - 1 was scheduled.
    assert [r["worst"] for r in results] == [0.0, 0.25, 0.5]
    assert [r["best"] for r in results] == [0.0, 0.0, 0.25]
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


# -- the worker thread and the side stream -------------------------------------------------------


def _worker_device_rank(rank: int, world_size: int) -> dict[str, Any]:
    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(last)  # with two GPUs or more, this process never uses GPU 0 itself
    metric = tt.SumMetric().to(f"cuda:{last}")
    with AsyncMetricCollector(
        metric
    ) as collector:  # the worker's device is set at bind, for either transport
        metric.update(torch.ones((), device=f"cuda:{last}"))
        # Read from inside the worker, where it runs the window.
        collector.schedule_collection(then=lambda results: (torch.cuda.current_device(), results))
        worker_device, results = collector.collect_results()
    return {
        "worker_device": worker_device,
        "results": results,
        "context_on_gpu0": bool(torch._C._cuda_hasPrimaryContext(0)),
        "last": last,
    }


def test_the_worker_thread_works_on_the_metrics_device() -> None:
    """35.1, read from inside the worker. A thread starts on GPU 0, so on one GPU the worker's device
    is the metrics' with or without the fix (`set_device(0)` is then a no-op in c10); on two GPUs or
    more the metrics sit on the last and the reverted worker reports GPU 0."""
    (outcome,) = run_ranks(_worker_device_rank, 1, timeout_s=240)
    assert outcome["worker_device"] == outcome["last"]
    assert outcome["results"] == [1.0]
    if outcome["last"] > 0:
        assert not outcome["context_on_gpu0"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_worker_sleeps_while_it_waits_for_the_device(transport: str) -> None:
    """35.2: each transport's worker waits on an event created with `blocking=True` (`_copied`,
    `_done`); with `blocking=False` it spins a core for the whole wait."""
    metrics = _metrics()
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        cpu = thread_cpu_clock(collector_worker())
        _update(metrics, 0)
        torch.cuda.synchronize()
        started, slept = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        busy_for(2.0)
        slept.record()
        collector.schedule_collection()
        cpu_before = cpu()
        collector.collect_results()
        worker_cpu = cpu() - cpu_before
    waited = started.elapsed_time(slept) / 1000  # what the device itself measured
    assert waited > 1.0, "the stream was not kept busy"
    assert worker_cpu < 0.25 * waited, f"the worker used {worker_cpu:.2f} s of CPU in a {waited:.2f} s wait"


def test_the_side_stream_has_a_higher_priority_than_the_training_stream() -> None:
    """35.5: read back from CUDA (`cudaStreamGetPriority`); at priority 0 it would queue behind the
    training's kernels."""
    metrics = {"big": tt.ConfusionMatrixMetric(600).to("cuda")}
    with AsyncMetricCollector(metrics, transport="device") as collector:
        side = collector._transport._stream  # type: ignore[union-attr]
        assert side.priority < torch.cuda.current_stream().priority
