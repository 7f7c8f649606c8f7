"""Device memory of one rank, read once per window from the host: no device work, no sync.

The allocator is read as `torch.cuda.memory_stats_as_nested_dict`: `torch.cuda.memory_stats` (and
`max_memory_allocated`, which calls it) flattens and sorts the same dict in Python, which cost about
0.5 ms of the training thread per call on an H200 host, three calls per window (bench/README.md).
Every memory signal of a `Telemetry` shares one `AllocatorStats`, which reads once per window.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from torchtelemetry.metric import MaxMetric, Metric, SumMetric

logger = logging.getLogger(__name__)

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
    """One reading of the CUDA caching allocator (bytes; retries and OOMs since the previous one)
    and of the device's free memory."""

    allocated: float
    peak_allocated: float
    reserved: float
    peak_active: float
    peak_reserved: float
    alloc_retries: float
    ooms: float
    free: float
    """What the device can still give (`cudaMemGetInfo`'s free bytes)."""


class AllocatorStats:
    """Reads the caching allocator's host-side counters (`torch.cuda.memory_stats_as_nested_dict`)
    and the device's free memory once per window.

    Peaks are since the process started or since the user last called
    `torch.cuda.reset_peak_memory_stats`; the library never resets them. Retries and OOMs are
    returned as the increase since the previous read, so summed over ranks and windows they give
    the run's totals. A count lower than the previous read means someone called
    `torch.cuda.reset_accumulated_memory_stats()`: the count restarted from 0, so the increase is
    the count itself (re-based, never negative). `memory_stats` and `mem_get_info` are the two
    CUDA calls; a test passes stand-ins to run the rest on a CPU.

    Shared by the signals that read it (`PeakMemory`, `MemoryHealth`): each window's first reader
    gets a new reading, the others that one (`read(reader)`). With `background`, the reading is
    made off the training thread: a window gets the one a reader thread made after the previous
    window asked for it (taken during the window's first steps, never counted twice), the first
    window and a final one (`now`, at close) read on the spot, as does a window whose reading is
    not ready yet.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        memory_stats: Callable[[torch.device], Mapping[str, Any]] = torch.cuda.memory_stats_as_nested_dict,
        mem_get_info: Callable[[torch.device], tuple[int, int]] = torch.cuda.mem_get_info,
        background: bool = False,
    ) -> None:
        self.device = device
        self._memory_stats = memory_stats
        self._mem_get_info = mem_get_info
        self._counts = {"num_alloc_retries": 0.0, "num_ooms": 0.0}
        self._reading: AllocatorReading | None = None
        self._readers: set[int] = set()
        self._background = background
        self._lock = threading.Lock()  # the counts' baseline, read by either thread
        self._ready: AllocatorReading | None = None
        """The reader thread's reading, not handed to a window yet."""
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def read(self, reader: object, *, now: bool = False) -> AllocatorReading:
        """The allocator's reading of this window: a new one if `reader` already had the last one
        (its next window) or none was made (read on the spot with `now`), else the last (a window's
        other readers)."""
        if self._reading is None or id(reader) in self._readers:
            with self._lock:
                ready, self._ready = self._ready, None
                self._reading = ready if ready is not None and not now else self._read(ready)
            self._readers = set()
            if self._background and not self._closed:
                self._ask_for_next()
        self._readers.add(id(reader))
        return self._reading

    def _ask_for_next(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="torchtelemetry-memory-reader", daemon=True
            )
            self._thread.start()
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._closed:
                return
            try:
                with self._lock:
                    self._ready = self._read()
            except Exception as error:  # a failed device: the training thread reads, and hears of it
                logger.warning("Telemetry: the memory reader thread stopped: %s", error)
                self._background = False
                return

    def close(self) -> None:
        """Stop the reader thread (bounded); later windows read on the spot."""
        self._closed = True
        self._wanted.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    def _read(self, unused: AllocatorReading | None = None) -> AllocatorReading:
        """A new reading (under `_lock`: the counts' baseline moves), with the retries and OOMs of a
        reading it replaces (`unused`: never counted)."""
        stats = self._memory_stats(self.device)
        free, _ = self._mem_get_info(self.device)
        reading = AllocatorReading(
            allocated=_all_pools(stats, "allocated_bytes", "current"),
            peak_allocated=_all_pools(stats, "allocated_bytes", "peak"),
            reserved=_all_pools(stats, "reserved_bytes", "current"),
            peak_active=_all_pools(stats, "active_bytes", "peak"),
            peak_reserved=_all_pools(stats, "reserved_bytes", "peak"),
            alloc_retries=self._increase(stats, "num_alloc_retries"),
            ooms=self._increase(stats, "num_ooms"),
            free=float(free),
        )
        if unused is None:
            return reading
        return reading._replace(
            alloc_retries=reading.alloc_retries + unused.alloc_retries, ooms=reading.ooms + unused.ooms
        )

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
