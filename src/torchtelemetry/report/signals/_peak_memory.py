"""Peak memory, max over ranks, and on CUDA the caching allocator's picture (`report._memory`).

`train/peak_memory`: peak CUDA memory allocated, else the process's peak resident memory.
On CUDA, `train/memory/max_active`, `max_reserved` (peaks) and `alloc_retries`, `ooms` (counters,
summed over ranks). Read once per window from host-side counters: no device work, no sync.
"""

from __future__ import annotations

from torchtelemetry.metric import MaxMetric, Metric, MetricKind
from torchtelemetry.report._flatten import describe_metrics
from torchtelemetry.report._memory import AllocatorStats, allocator_metrics, resident_peak
from torchtelemetry.report._values import MetricDescriptor
from torchtelemetry.report.signals._base import Signal, SignalContext

__all__ = ["PEAK_MEMORY", "PeakMemory"]

PEAK_MEMORY = "train/peak_memory"
ALLOCATOR = "train/memory"


class PeakMemory(Signal):
    """Peak memory of every rank, max over ranks; the CUDA allocator's detail on CUDA."""

    name = "peak_memory"

    def __init__(self, context: SignalContext, allocator: AllocatorStats | None = None) -> None:
        """`allocator`: where the CUDA detail is read (by default the device's allocator on CUDA,
        none elsewhere)."""
        super().__init__(context)
        self.peak = MaxMetric(
            unit="bytes", description="Peak device memory allocated (CUDA), else peak resident memory"
        ).to(context.device)
        if allocator is None and context.device.type == "cuda":
            allocator = AllocatorStats(context.device)
        self.allocator = allocator
        self.memory = allocator_metrics() if allocator is not None else {}
        for metric in self.memory.values():
            metric.to(context.device)

    def metrics(self) -> dict[str, Metric]:
        return {PEAK_MEMORY: self.peak, **{f"{ALLOCATOR}/{name}": m for name, m in self.memory.items()}}

    def descriptors(self) -> list[MetricDescriptor]:
        described = [MetricDescriptor(PEAK_MEMORY, MetricKind.GAUGE, "bytes", self.peak.description)]
        return described + (self.cuda_descriptors() if self.memory else [])

    @staticmethod
    def cuda_descriptors() -> list[MetricDescriptor]:
        """The CUDA allocator's names (`train/memory/...`)."""
        return describe_metrics({"train": {"memory": allocator_metrics()}})

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self.allocator is None:
            self.peak.extremum.update(resident_peak())
        else:
            reading = self.allocator.read(self, now=final)
            self.peak.extremum.update(reading.peak_allocated)
            self.memory["max_active"].extremum.update(reading.peak_active)
            self.memory["max_reserved"].extremum.update(reading.peak_reserved)
            self.memory["alloc_retries"].total.update(reading.alloc_retries)
            self.memory["ooms"].total.update(reading.ooms)

    def close(self) -> None:
        if self.allocator is not None:
            self.allocator.close()
