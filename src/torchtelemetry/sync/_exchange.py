"""One window's packed buffers across the ranks: ONE collective while the payload is small.

Every bucket of a window lives in one byte "slot" (8-byte aligned regions, one per bucket).
While `world_size x slot bytes <= GATHER_LIMIT_BYTES`, the slots are gathered in one
all-reduce (each rank writes its slot into its own row of a zeroed `world_size x slot` buffer;
a SUM of zeros and one value is that value, bit for bit) and every rank reduces the rows
locally: SUM buckets by a sum, MAX buckets (MIN folded in by negation) by a max. Exact for any
op mix, whatever the dtypes. Above the limit (or with a single bucket), one all-reduce per
bucket, in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.sync._buckets import BucketKey, BucketLayout, ReduceOp
from torchtelemetry.sync._group import group_rank, group_world_size
from torchtelemetry.sync._reduce import reduce_buffers, verify_layout

__all__ = ["GATHER_LIMIT_BYTES", "Slot", "WindowExchange", "gathers", "slot_regions"]

GATHER_LIMIT_BYTES = 256 * 1024
"""World size x packed bytes up to which a window is one collective whatever its op mix."""

_ALIGN = 8


@dataclass(frozen=True, slots=True)
class Slot:
    """One window's packed buckets: their bytes and each bucket's typed view into them."""

    data: torch.Tensor
    buffers: dict[BucketKey, torch.Tensor]
    rows: torch.Tensor | None
    """This slot's own gather buffer (`world_size` rows of the slot), else the exchange's shared one."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def slot_regions(layout: BucketLayout) -> tuple[dict[BucketKey, tuple[int, int, torch.dtype]], int]:
    """Each bucket's `(start, bytes, dtype)` in a slot of `layout`, 8-byte aligned, and the slot's size."""
    regions: dict[BucketKey, tuple[int, int, torch.dtype]] = {}
    offset = 0
    for key in layout.buckets:
        dtype = getattr(torch, key.dtype.removeprefix("torch."))
        nbytes = layout.size(key) * dtype.itemsize
        regions[key] = (offset, nbytes, dtype)
        offset += _aligned(nbytes)
    return regions, max(offset, _ALIGN)


def gathers(buckets: int, slot_bytes: int, world_size: int) -> bool:
    """Whether a window of `buckets` buckets in `slot_bytes` is ONE gathered all-reduce over `world_size`
    ranks (else one all-reduce per bucket)."""
    return world_size > 1 and buckets > 1 and world_size * slot_bytes <= GATHER_LIMIT_BYTES


class WindowExchange:
    """Reduces slots laid out by `layout` across `group` (None: locally, nothing to do)."""

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None) -> None:
        self.layout = layout
        self.group = group
        self.world_size = group_world_size(group)
        self.rank = group_rank(group)
        self._regions, self.slot_bytes = slot_regions(layout)
        self.gathered = group is not None and gathers(len(self._regions), self.slot_bytes, self.world_size)
        self._shared_rows: dict[torch.device, torch.Tensor] = {}

    def new_slot(self, device: torch.device, *, pin_memory: bool = False, private_rows: bool = False) -> Slot:
        """A zeroed slot on `device` (pinned host memory with `pin_memory`). Slots reduced
        concurrently (several windows in flight at once) each need `private_rows`."""
        data = torch.zeros(self.slot_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
        buffers = {
            key: data[start : start + nbytes].view(dtype)
            for key, (start, nbytes, dtype) in self._regions.items()
        }
        rows = self._new_rows(device) if private_rows and self.gathered else None
        return Slot(data, buffers, rows)

    def _new_rows(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.world_size, self.slot_bytes // _ALIGN, dtype=torch.int64, device=device)

    def _rows(self, slot: Slot) -> torch.Tensor:
        if slot.rows is not None:
            return slot.rows
        device = slot.data.device
        if device not in self._shared_rows:
            self._shared_rows[device] = self._new_rows(device)
        return self._shared_rows[device]

    def reduce(self, slot: Slot, *, async_op: bool = False) -> list[Any]:
        """Issue the window's collective(s) on `slot` (MIN parts already negated); the Work handles
        if `async_op`. The first time a layout is seen on the group, all ranks check that they
        agree on it first (one small blocking collective)."""
        if self.group is None:
            return []
        if not self.gathered:
            return reduce_buffers(self.layout, slot.buffers, self.group, async_op=async_op)
        verify_layout(self.layout, self.group, slot.data.device)
        rows = self._rows(slot)
        rows.zero_()
        rows[self.rank].copy_(slot.data.view(torch.int64))
        work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return [] if work is None else [work]

    def reduced(self, slot: Slot) -> dict[BucketKey, torch.Tensor]:
        """The reduced buckets once `reduce`'s work is complete, MIN parts negated back."""
        buffers = slot.buffers
        if self.gathered:
            rows = self._rows(slot).view(torch.uint8)
            buffers = {}
            for key, (start, nbytes, dtype) in self._regions.items():
                per_rank = rows[:, start : start + nbytes].view(dtype)
                buffers[key] = (
                    per_rank.sum(0, dtype=dtype) if key.reduce_op is ReduceOp.SUM else per_rank.amax(0)
                )
        return self.layout.negate_min_(buffers)
