"""Device memory of one rank, read once per window from the host: no device work, no sync.

The allocator is read as `torch.cuda.memory_stats_as_nested_dict`: `torch.cuda.memory_stats` (and
`max_memory_allocated`, which calls it) flattens and sorts the same dict in Python, which cost about
0.5 ms of the training thread per call on an H200 host, three calls per window (bench/README.md).
Every memory signal of a `Telemetry` shares one `AllocatorStats`, which reads once per window.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from torchtelemetry.metric import MaxMetric, Metric, SumMetric

__all__ = ["AllocatorReading", "AllocatorStats", "allocator_metrics", "resident_peak"]


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


class AllocatorReading(NamedTuple):
    """One reading of the CUDA caching allocator (bytes; retries and OOMs since the previous one)."""

    allocated: float
    peak_allocated: float
    reserved: float
    peak_active: float
    peak_reserved: float
    alloc_retries: float
    ooms: float


class AllocatorStats:
    """Reads the caching allocator's host-side counters (`torch.cuda.memory_stats_as_nested_dict`)
    once per window.

    Peaks are since the process started or since the user last called
    `torch.cuda.reset_peak_memory_stats`; the library never resets them. Retries and OOMs are
    returned as the increase since the previous read, so summed over ranks and windows they give
    the run's totals. A count lower than the previous read means someone called
    `torch.cuda.reset_accumulated_memory_stats()`: the count restarted from 0, so the increase is
    the count itself (re-based, never negative). `memory_stats` and `mem_get_info` are the two
    CUDA calls; a test passes stand-ins to run the rest on a CPU.

    Shared by the signals that read it (`PeakMemory`, `MemoryHealth`): each window's first reader
    reads the allocator, the others get that reading (`read(reader)`).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        memory_stats: Callable[[torch.device], Mapping[str, Any]] = torch.cuda.memory_stats_as_nested_dict,
        mem_get_info: Callable[[torch.device], tuple[int, int]] = torch.cuda.mem_get_info,
    ) -> None:
        self.device = device
        self._memory_stats = memory_stats
        self._mem_get_info = mem_get_info
        self._counts = {"num_alloc_retries": 0.0, "num_ooms": 0.0}
        self._reading: AllocatorReading | None = None
        self._readers: set[int] = set()

    def read(self, reader: object) -> AllocatorReading:
        """The allocator's reading of this window: read now if `reader` already had the last one
        (its next window) or none was made, else the last (a window's other readers). Retries and
        OOMs are since the previous reading."""
        if self._reading is None or id(reader) in self._readers:
            self._reading = self._read()
            self._readers = set()
        self._readers.add(id(reader))
        return self._reading

    def _read(self) -> AllocatorReading:
        stats = self._memory_stats(self.device)
        return AllocatorReading(
            allocated=_all_pools(stats, "allocated_bytes", "current"),
            peak_allocated=_all_pools(stats, "allocated_bytes", "peak"),
            reserved=_all_pools(stats, "reserved_bytes", "current"),
            peak_active=_all_pools(stats, "active_bytes", "peak"),
            peak_reserved=_all_pools(stats, "reserved_bytes", "peak"),
            alloc_retries=self._increase(stats, "num_alloc_retries"),
            ooms=self._increase(stats, "num_ooms"),
        )

    def free_bytes(self) -> float:
        """What the device can still give (`cudaMemGetInfo`'s free bytes)."""
        free, _ = self._mem_get_info(self.device)
        return float(free)

    def _increase(self, stats: Mapping[str, Any], key: str) -> float:
        count, previous = float(stats.get(key, 0)), self._counts[key]
        self._counts[key] = count
        return count - previous if count >= previous else count


def _all_pools(stats: Mapping[str, Any], quantity: str, field: str) -> float:
    """`stats[quantity]["all"][field]` of the nested statistics (0 where the allocator has none)."""
    return float(stats.get(quantity, {}).get("all", {}).get(field, 0))


def resident_peak() -> float:
    """The process's peak resident memory (bytes)."""
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
