"""Windows in flight on a CUDA device (`make gpu-check`), on ONE GPU: memory the side stream still
writes (35.4), CUDA graph capture (35.7), custom computes on the device transport (35.8) and NCCL's
blocking wait (35.6). Each test names the fix it holds and fails with that fix reverted."""

from __future__ import annotations

import threading
import weakref
from typing import Any, ClassVar

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import nccl_world_of_one
from tests.gpu import busy_for
from tests.hostsync import NoHostSync
from torchtelemetry.collect import AsyncMetricCollector

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TRANSPORTS = ["host", "device"]


def test_a_timed_out_unbind_never_hands_out_memory_the_side_stream_still_writes() -> None:
    """35.4: every device slot is `record_stream`ed on the side stream at bind. Three windows are in
    flight on a real NCCL group (NCCL and the MIN negation write the slots on the side stream),
    each behind its own long kernel on the training stream; `unbind()` gives up on them, and once
    the worker (which held the transport while it waited for the first window) lets go, the slots
    go back to the allocator while the side stream still has the other two windows to run. Without
    `record_stream` the allocator hands those slots to the fresh tensors of the same size at once."""
    with nccl_world_of_one():
        metrics = {"best": tt.MinMetric().to("cuda"), "big": tt.ConfusionMatrixMetric(600).to("cuda")}
        collector = AsyncMetricCollector(metrics, transport="device", max_pending=3).bind()
        transport = collector._transport
        freed = threading.Event()
        weakref.finalize(transport, freed.set)
        slot_bytes = transport._slots[0].data.numel()  # type: ignore[union-attr]
        slots = [slot.data.data_ptr() for slot in transport._slots]  # type: ignore[union-attr]
        del transport
        torch.cuda.synchronize()
        for window in range(3):
            metrics["best"].update(torch.full((), float(window), device="cuda"))
            busy_for(2.0)  # the side stream runs window w only after this
            collector.schedule_collection()
        collector.unbind(timeout_s=0.01)  # gives up: the slots go back to the allocator
        assert freed.wait(timeout=60), "the transport was never released"
        fresh = [torch.full((slot_bytes,), 7, dtype=torch.uint8, device="cuda") for _ in range(8)]
        side_stream_pending = not torch.cuda.current_stream().query()  # windows 2 and 3 wait behind it
        reused = [
            tensor.data_ptr()
            for tensor in fresh
            if any(start - slot_bytes < tensor.data_ptr() < start + slot_bytes for start in slots)
        ]
        torch.cuda.synchronize()
    assert side_stream_pending, "the windows in flight finished before the fresh allocations"
    assert not reused, "the allocator handed out slots the side stream still had to write"
    assert all(bool((tensor == 7).all()) for tensor in fresh)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_update_is_captured_in_a_cuda_graph_while_windows_are_in_flight(transport: str) -> None:
    """35.7: in `capture_error_mode="thread_local"` (docs/collection.md) the worker may wait on its
    events while the training thread captures. The capture stays open until both windows in flight
    were collected, so the worker waits on the second window's event during the capture; in the
    default "global" mode that wait fails and invalidates the capture."""
    loss, tokens = torch.zeros((), device="cuda"), torch.full((), 4.0, device="cuda")
    metrics = {"loss": tt.WeightedMeanMetric().to("cuda"), "big": tt.ConfusionMatrixMetric(600).to("cuda")}
    with AsyncMetricCollector(metrics, transport=transport, max_pending=2) as collector:  # type: ignore[arg-type]
        for window in range(2):
            metrics["loss"].update(torch.full((), float(window), device="cuda"), 1.0)
            busy_for(1.0)
            collector.schedule_collection()
        graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(capture_stream):  # not behind the busy training stream
            graph.capture_begin(capture_error_mode="thread_local")
            metrics["loss"].update(loss, tokens)
            in_flight = [collector.collect_results()["loss"] for _ in range(2)]
            graph.capture_end()
        torch.cuda.synchronize()
        for value in (1.0, 3.0):
            loss.fill_(value)
            graph.replay()
        collector.schedule_collection()
        replayed = collector.collect_results()["loss"]
    assert in_flight == [0.0, 1.0]
    assert replayed == 2.0  # (1 x 4 + 3 x 4) / 8


class ScaledHistogram(tt.HistogramMetric):
    """A subclass with its own compute() reading a tensor attribute (bounds) that `to()` moved."""

    def compute(self) -> dict[str, torch.Tensor]:
        results = super().compute()
        results["bounds"] = self.bounds * 2
        return results


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_custom_metric_on_cuda_gets_a_right_first_window(transport: str) -> None:
    """Its tensor attributes reach the host at bind (the host transport computes there, and so does
    the device transport for custom metrics)."""
    metrics = {
        "h": ScaledHistogram(bins=[1.0, 2.0]).to("cuda"),
        "big": tt.ConfusionMatrixMetric(600).to("cuda"),
    }
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        metrics["h"].update(torch.tensor([0.5, 1.5, 9.0], device="cuda"))
        collector.schedule_collection()
        result = collector.collect_results()["h"]
    assert result == {"bounds": [2.0, 4.0], "counts": [1.0, 1.0, 1.0], "sum": 11.0, "count": 3.0}


class LeadingCounts(tt.Metric):
    """A custom compute() that reads a value on the host and sizes its results by it."""

    computed_on: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.counts = tt.MetricAccumulator(torch.zeros(4, dtype=torch.float64), "sum")

    def update(self, counts: torch.Tensor) -> None:
        self.counts.update(counts)

    def compute(self) -> dict[str, Any]:
        LeadingCounts.computed_on.append(threading.current_thread().name)
        seen = int(self.counts.value.count_nonzero().item())
        return {"leading": self.counts.value[:seen], "seen": seen}


def test_a_custom_compute_on_the_device_transport_never_runs_on_the_training_thread() -> None:
    """35.8: the training thread enqueues only the built-in rules; the custom metric's states ride the
    packed copy and its compute() (an `.item()`, a result whose shape changes) runs on the worker.
    Reverted, `.item()` syncs this thread (NoHostSync and the sync debug mode raise) and the new
    shape allocates pinned memory here."""
    metrics = {"leading": LeadingCounts().to("cuda"), "big": tt.ConfusionMatrixMetric(600).to("cuda")}
    counts = [torch.tensor(c, dtype=torch.float64, device="cuda") for c in ([1, 0, 0, 0], [1, 1, 1, 0])]
    with nccl_world_of_one(), AsyncMetricCollector(metrics, transport="device", max_pending=2) as collector:
        torch.cuda.synchronize()
        LeadingCounts.computed_on.clear()
        pinned_before = torch.cuda.host_memory_stats()["active_requests.allocated"]
        torch.cuda.set_sync_debug_mode("error")
        try:
            with NoHostSync():
                for window_counts in counts:
                    metrics["leading"].update(window_counts)
                    collector.schedule_collection()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        pinned_after = torch.cuda.host_memory_stats()["active_requests.allocated"]
        results = [collector.collect_results()["leading"] for _ in range(2)]
    assert results == [{"leading": [1.0], "seen": 1}, {"leading": [1.0, 1.0, 1.0], "seen": 3}]
    assert pinned_after == pinned_before
    assert LeadingCounts.computed_on and "MainThread" not in LeadingCounts.computed_on


def test_schedule_returns_at_once_under_nccl_blocking_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """35.6: with `TORCH_NCCL_BLOCKING_WAIT=1` (read when the group is created) the device transport's
    `Work.wait()` would wait on this thread for the stream to reach the snapshot; "auto" takes the
    host transport instead for a state the size of which would pick the device transport."""
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    metrics = {"big": tt.ConfusionMatrixMetric(600).to("cuda")}
    with nccl_world_of_one():
        with AsyncMetricCollector(metrics) as collector:
            in_use = collector.transport_in_use()
            busy_for(2.0)
            collector.schedule_collection()
            busy = not torch.cuda.current_stream().query()
            result = collector.collect_results()["big"]
        with pytest.raises(ValueError, match="TORCH_NCCL_BLOCKING_WAIT=1"):
            AsyncMetricCollector(
                {"other": tt.ConfusionMatrixMetric(600).to("cuda")}, transport="device"
            ).bind()
    assert in_use == "host"
    assert busy, "schedule_collection() waited for the training stream"
    assert len(result["precision"]) == 600
