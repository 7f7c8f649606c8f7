"""One window's packed buffers across the ranks: ONE collective while that is the cheaper way.

Every bucket of a window lives in one byte "slot" (8-byte aligned regions, one per bucket). The
slots can be gathered in one all-reduce (each rank writes its slot into its own row of a zeroed
`world_size x slot` buffer; a SUM of zeros and one value is that value, bit for bit) and every
rank reduces the rows locally: SUM buckets by a sum, MAX buckets (MIN folded in by negation) by a
max. Exact for any op mix, whatever the dtypes. Or each bucket is all-reduced in place, one
collective per bucket. The gather saves the ring steps of all but one collective and sends
`world_size` times the bytes: it is chosen when the cost model (`torchtelemetry.sync._cost`,
docs/scale.md) says it takes less time, and while its buffer is at most `GATHER_LIMIT_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.sync._buckets import BucketKey, BucketLayout, ReduceOp
from torchtelemetry.sync._cost import WindowCost, ring_all_reduce
from torchtelemetry.sync._group import group_rank, group_world_size
from torchtelemetry.sync._reduce import reduce_buffers, verify_layout

__all__ = [
    "GATHER_LIMIT_BYTES",
    "Slot",
    "WindowExchange",
    "gathers",
    "slot_holding",
    "slot_regions",
    "window_cost",
]

GATHER_LIMIT_BYTES = 1 << 20
"""The largest gather buffer (world size x packed bytes): what the gather costs in memory, and about
half of what each rank sends for it per window."""

_ALIGN = 8


@dataclass(frozen=True, slots=True)
class Slot:
    """One window's packed buckets: their bytes and each bucket's typed view into them."""

    data: torch.Tensor
    buffers: dict[BucketKey, torch.Tensor]
    rows: torch.Tensor | None
    """This slot's own gather buffer (`world_size` rows of the slot), else the exchange's shared one."""
    host: dict[BucketKey, memoryview] | None = None
    """On the CPU, for `slot_holding`'s slots: each float64 bucket's memory as Python writes it (the
    same bytes as its buffer)."""


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


def slot_holding(layout: BucketLayout, tensors: list[torch.Tensor]) -> Slot:
    """A new slot holding `tensors` (in `layout`'s entry order) as they are, MIN entries not negated:
    storage laid out as every slot of `layout` is, so that one copy of its bytes fills a slot."""
    regions, slot_bytes = slot_regions(layout)
    device = tensors[0].device if tensors else torch.device("cpu")
    host = None
    if device.type == "cpu":  # host memory Python writes as well (`Slot.host`)
        memory = memoryview(bytearray(slot_bytes))
        data = torch.frombuffer(memory, dtype=torch.uint8)
        host = {
            key: memory[start : start + nbytes].cast("d")
            for key, (start, nbytes, dtype) in regions.items()
            if dtype == torch.float64
        }
    else:
        data = torch.zeros(slot_bytes, dtype=torch.uint8, device=device)
    buffers = {
        key: data[start : start + nbytes].view(dtype) for key, (start, nbytes, dtype) in regions.items()
    }
    for key, packed in layout.storage(tensors).items():
        buffers[key].copy_(packed)
    return Slot(data, buffers, None, host)


def _per_bucket(bucket_bytes: list[int], world_size: int) -> WindowCost:
    return sum((ring_all_reduce(nbytes, world_size) for nbytes in bucket_bytes), WindowCost(0, 0, 0.0))


def gathers(bucket_bytes: list[int], slot_bytes: int, world_size: int) -> bool:
    """Whether one collection's buckets of `bucket_bytes` (packed in `slot_bytes`) is ONE gathered
    all-reduce over `world_size` ranks: when that takes less time than one all-reduce per bucket
    (by the cost model) and its buffer is at most `GATHER_LIMIT_BYTES`."""
    if world_size < 2 or len(bucket_bytes) < 2 or world_size * slot_bytes > GATHER_LIMIT_BYTES:
        return False
    gather = ring_all_reduce(world_size * slot_bytes, world_size)
    return gather.seconds() <= _per_bucket(bucket_bytes, world_size).seconds()


def window_cost(layout: BucketLayout, world_size: int) -> WindowCost:
    """What reducing one collection of `layout` over `world_size` ranks costs each rank, the way
    `WindowExchange` does it; steady state, after the one-off layout check."""
    regions, slot_bytes = slot_regions(layout)
    bucket_bytes = [nbytes for _, nbytes, _ in regions.values()]
    if gathers(bucket_bytes, slot_bytes, world_size):
        return ring_all_reduce(world_size * slot_bytes, world_size)
    return _per_bucket(bucket_bytes, world_size)


class WindowExchange:
    """Reduces slots laid out by `layout` across `group` (None: locally, nothing to do)."""

    def __init__(self, layout: BucketLayout, group: dist.ProcessGroup | None) -> None:
        self.layout = layout
        self.group = group
        self.world_size = group_world_size(group)
        self.rank = group_rank(group)
        self._regions, self.slot_bytes = slot_regions(layout)
        self.gathered = group is not None and gathers(
            [nbytes for _, nbytes, _ in self._regions.values()], self.slot_bytes, self.world_size
        )
        self._shared_rows: dict[torch.device, torch.Tensor] = {}
        self._reductions: dict[
            int, tuple[torch.Tensor, dict[BucketKey, tuple[torch.Tensor, torch.Tensor]]]
        ] = {}
        """By the id of a gather's rows (held): each bucket's per-rank view and its reduced buffer."""

    def new_slot(self, device: torch.device, *, pin_memory: bool = False, private_rows: bool = False) -> Slot:
        """A zeroed slot on `device` (pinned host memory with `pin_memory`). Slots reduced
        concurrently (several collections in flight at once) each need `private_rows`."""
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

    def verify(self, device: torch.device) -> None:
        """Check now that every rank holds this layout (one small blocking collective on `device`,
        once per group and layout); `reduce` then issues no check."""
        if self.group is not None:
            verify_layout(self.layout, self.group, device)

    def negate_min_(self, slot: Slot) -> None:
        """Negate the MIN parts of `slot` for `reduce` (which takes their maximum); without a group
        there is no reduce, and `reduced` does not negate them back."""
        if self.group is not None:
            self.layout.negate_min_(slot.buffers)

    def reduce(self, slot: Slot, *, async_op: bool = False) -> list[Any]:
        """Issue the window's collective(s) on `slot` (`negate_min_` already called); the Work handles
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
        """The reduced buckets once `reduce`'s work is complete, MIN parts negated back (`negate_min_`
        negated them): the slot's own buffers, or (gathered) buffers that belong to its rows, the same
        every window."""
        buffers = slot.buffers
        if self.gathered:
            buffers = {}
            for key, (per_rank, out) in self._reductions_of(self._rows(slot)).items():
                if key.reduce_op is ReduceOp.SUM:
                    torch.sum(per_rank, 0, dtype=out.dtype, out=out)
                else:
                    torch.amax(per_rank, 0, out=out)
                buffers[key] = out
        return buffers if self.group is None else self.layout.negate_min_(buffers)

    def _reductions_of(self, rows: torch.Tensor) -> dict[BucketKey, tuple[torch.Tensor, torch.Tensor]]:
        """Each bucket's per-rank view of `rows` and the buffer it is reduced into, made once per rows
        (held with them, so that the id stays theirs)."""
        found = self._reductions.get(id(rows))
        if found is None:
            per_rank = rows.view(torch.uint8)
            reductions = {}
            for key, (start, nbytes, dtype) in self._regions.items():
                view = per_rank[:, start : start + nbytes].view(dtype)
                reductions[key] = (view, torch.empty(view.shape[1:], dtype=dtype, device=view.device))
            found = self._reductions[id(rows)] = (rows, reductions)
        return found[1]
