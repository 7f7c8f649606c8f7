"""Memory health of every rank, reduced over ranks with the rank that holds the extreme as a value.

Read once per window on the host (the CUDA caching allocator's counters, `cudaMemGetInfo`, the
process's resident set): no device work, no sync. Each rank writes its own slot of a per-rank
state that rides the window (`RankValues`), so the exporting rank knows every rank's values without
a collective of its own. Exported under `train/memory/`, at any world size:

| quantity | per rank | exported |
| --- | --- | --- |
| `allocated` | bytes in live tensors (CUDA) | `/max`, `/max_rank` |
| `reserved` | bytes the caching allocator holds (CUDA) | `/max`, `/max_rank` |
| `fragmentation` | reserved - allocated: cached, not in use (CUDA) | `/max`, `/max_rank` |
| `headroom` | bytes the device can still give (`cudaMemGetInfo` free) | `/min`, `/min_rank` |
| `alloc_retries`, `ooms` | the window's allocator retries and OOMs (CUDA) | `/max_rank` (once any) |
| `rss` | resident set of the process (every device) | `/max`, `/max_rank` |

Values are the largest (headroom: smallest) read on the rank during the window. Retries and OOMs
are counted once, run-wide, by `PeakMemory` (`train/memory/alloc_retries`, `train/memory/ooms`:
counters summed over ranks); here only the rank with the most in the window is named. Both read
`AllocatorStats`, which re-bases after `torch.cuda.reset_accumulated_memory_stats()`.
"""

from __future__ import annotations

import contextlib
import os
import resource

from torchtelemetry.metric import Metric, MetricKind, ReduceOp
from torchtelemetry.report._memory import AllocatorStats
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import (
    RankValues,
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)

__all__ = ["MemoryHealth", "memory_descriptors", "resident_bytes"]

PREFIX = "train/memory"
STATE = "train/memory/ranks"
HEADROOM_STATE = "train/memory/headroom_ranks"
CUDA_QUANTITIES = ("allocated", "reserved", "fragmentation", "alloc_retries", "ooms")
COUNTED = ("alloc_retries", "ooms")
DESCRIPTIONS = {
    "allocated": ("bytes", "Bytes in live CUDA tensors"),
    "reserved": ("bytes", "Bytes held by the CUDA caching allocator"),
    "fragmentation": ("bytes", "Bytes reserved by the CUDA caching allocator but not allocated"),
    "alloc_retries": ("", "CUDA allocations retried after freeing the allocator's cache in the window"),
    "ooms": ("", "CUDA out-of-memory errors in the window"),
    "rss": ("bytes", "Resident memory of the process"),
    "headroom": ("bytes", "Device memory still free (cudaMemGetInfo)"),
}


class MemoryHealth(Signal):
    """Per-rank memory, reduced (see the module)."""

    name = "memory"

    def __init__(self, context: SignalContext, allocator: AllocatorStats | None = None) -> None:
        """`allocator`: where the CUDA quantities are read (by default the device's allocator on
        CUDA, none elsewhere: then only `rss`)."""
        super().__init__(context)
        if allocator is None and context.device.type == "cuda":
            allocator = AllocatorStats(context.device)
        self.allocator = allocator
        self.cuda = allocator is not None
        self.quantities = (*CUDA_QUANTITIES, "rss") if self.cuda else ("rss",)
        self.ranks = RankValues(context.world_size, context.rank, self.quantities).to(context.device)
        self.headroom = (
            RankValues(context.world_size, context.rank, ("headroom",), op=ReduceOp.MIN).to(context.device)
            if self.cuda
            else None
        )

    def metrics(self) -> dict[str, Metric]:
        state: dict[str, Metric] = {STATE: self.ranks}
        if self.headroom is not None:
            state[HEADROOM_STATE] = self.headroom
        return state

    def descriptors(self) -> list[MetricDescriptor]:
        return memory_descriptors(cuda=self.cuda)

    @staticmethod
    def cuda_descriptors() -> list[MetricDescriptor]:
        on_cpu = {descriptor.name for descriptor in memory_descriptors(cuda=False)}
        return [d for d in memory_descriptors(cuda=True) if d.name not in on_cpu]

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        values = {"rss": float(resident_bytes())}
        if self.allocator is not None:
            reading = self.allocator.read(self, now=final)
            values.update(
                allocated=reading.allocated,
                reserved=reading.reserved,
                fragmentation=reading.reserved - reading.allocated,
                alloc_retries=reading.alloc_retries,
                ooms=reading.ooms,
            )
            assert self.headroom is not None
            self.headroom.write(0, reading.free)
        for index, quantity in enumerate(self.quantities):
            self.ranks.write(index, values[quantity])

    def close(self) -> None:
        if self.allocator is not None:
            self.allocator.close()

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        for quantity in self.quantities:
            by_rank = finite_by_rank(window.pop(f"{STATE}/{quantity}", None))
            if not by_rank:
                continue
            rank = highest_rank(by_rank)
            if quantity not in COUNTED:
                window[f"{PREFIX}/{quantity}/max"] = by_rank[rank]
                window[f"{PREFIX}/{quantity}/max_rank"] = float(rank)
            elif by_rank[rank] > 0:  # the count itself is PeakMemory's counter
                window[f"{PREFIX}/{quantity}/max_rank"] = float(rank)
        headroom = finite_by_rank(window.pop(f"{HEADROOM_STATE}/headroom", None))
        if headroom:
            rank = lowest_rank(headroom)
            window[f"{PREFIX}/headroom/min"] = headroom[rank]
            window[f"{PREFIX}/headroom/min_rank"] = float(rank)


def memory_descriptors(*, cuda: bool) -> list[MetricDescriptor]:
    """What `MemoryHealth` exports, training on CUDA or not."""
    quantities = (*CUDA_QUANTITIES, "rss") if cuda else ("rss",)
    out = []
    for quantity in quantities:
        unit, description = DESCRIPTIONS[quantity]
        if quantity in COUNTED:
            out.append(
                MetricDescriptor(
                    f"{PREFIX}/{quantity}/max_rank",
                    description=f"Rank with the most {quantity} in the window (counter: {PREFIX}/{quantity})",
                )
            )
            continue
        out.append(
            MetricDescriptor(
                f"{PREFIX}/{quantity}/max", MetricKind.GAUGE, unit, f"{description}, max over ranks"
            )
        )
        out.append(
            MetricDescriptor(f"{PREFIX}/{quantity}/max_rank", description=f"Rank with the most {quantity}")
        )
    if cuda:
        unit, description = DESCRIPTIONS["headroom"]
        out.append(
            MetricDescriptor(
                f"{PREFIX}/headroom/min", MetricKind.GAUGE, unit, f"{description}, min over ranks"
            )
        )
        out.append(
            MetricDescriptor(f"{PREFIX}/headroom/min_rank", description="Rank with the least headroom")
        )
    return out


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Process-global: /proc/<pid>/statm is one process's own file, so each process holds its own.
_STATM: dict[int, int] = {}
"""An open `/proc/<pid>/statm` per process id: one `pread` per reading (a fork reads its own)."""


def _close_statm_in_child() -> None:
    """A fork inherits its parent's open statm, which it never reads: close it at once."""
    for fd in _STATM.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _STATM.clear()


os.register_at_fork(after_in_child=_close_statm_in_child)


def resident_bytes() -> int:
    """The process's resident set now (Linux `/proc/<pid>/statm`), else its peak (`getrusage`)."""
    pid = os.getpid()
    try:
        if pid not in _STATM:
            _STATM.clear()
            _STATM[pid] = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        return int(os.pread(_STATM[pid], 256, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
