"""Device memory of one rank, read once per window from the host: no device work, no sync."""

from __future__ import annotations

import resource

import torch

from torchtelemetry.metric import MaxMetric, Metric, SumMetric

__all__ = ["AllocatorStats", "allocator_metrics", "peak_memory"]


def allocator_metrics() -> dict[str, Metric]:
    """The CUDA caching allocator's picture (`train/memory/...`), as torchtitan's memory monitor logs it."""
    return {
        "max_active": MaxMetric(
            unit="bytes", description="Peak memory in active CUDA blocks, max over ranks"
        ),
        "max_reserved": MaxMetric(
            unit="bytes", description="Peak memory reserved by the CUDA caching allocator, max over ranks"
        ),
        "alloc_retries": SumMetric(
            kind="counter", description="CUDA allocations retried after freeing the allocator's cache"
        ),
        "ooms": SumMetric(kind="counter", description="CUDA out-of-memory errors raised by the allocator"),
    }


class AllocatorStats:
    """Reads `torch.cuda.memory_stats` (host-side counters of the caching allocator) once per window.

    Peaks are since the process started or since the user last called
    `torch.cuda.reset_peak_memory_stats`; the library never resets them. Retries and OOMs are
    returned as the increase since the previous read, so summed over ranks and windows they
    give the run's totals.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._retries = 0.0
        self._ooms = 0.0

    def read(self) -> list[float]:
        """[max active bytes, max reserved bytes, new allocation retries, new OOMs]."""
        stats = torch.cuda.memory_stats(self.device)
        retries, ooms = float(stats.get("num_alloc_retries", 0)), float(stats.get("num_ooms", 0))
        new = [retries - self._retries, ooms - self._ooms]
        self._retries, self._ooms = retries, ooms
        return [
            float(stats.get("active_bytes.all.peak", 0)),
            float(stats.get("reserved_bytes.all.peak", 0)),
            *new,
        ]


def peak_memory(device: torch.device) -> float:
    """Peak CUDA memory allocated on `device`, else the process's peak resident memory (bytes)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
