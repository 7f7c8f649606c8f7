"""`StagedRows`: the staged entries of one buffer, their operands kept in order until a flush
gathers them into a float64 block on the buffer's device."""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StagedRows"]

CACHED = 64
"""Blocks (one per number of entries) and plans (one per pattern of entries) kept per rows."""
_STAGED = torch.float64


class StagedRows:
    """Entries staged for one buffer: each a mark (an int the caller gives: where it goes) and
    `count` operands, each a Python number (kept on the host) or a 0-d tensor (copied at the flush:
    one `_foreach_copy_` per dtype into its float64 slot). The operands of n entries fill an
    (n, count) float64 block in the order they came.

    A step stages the same entries every time, so what a flush needs beyond the operands (which
    slots each dtype's tensors go to, and what the caller's `prepare` makes of the marks: index
    tensors) is a plan made once per pattern of marks and operand kinds and kept."""

    __slots__ = ("_blocks", "_by_dtype", "_plans", "count", "device", "marks", "slots", "tensors", "versions")

    def __init__(self, count: int, device: torch.device) -> None:
        self.count = count
        self.device = device
        self.marks: list[int] = []
        """Each entry's mark."""
        self.slots: list[Any] = []
        """Each operand's kind and value, in order: (None, the number) or (the tensor's dtype, 0.0)."""
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        """Each staged tensor's version when staged: one changed in place since is caught."""
        self._by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        self._blocks: dict[int, tuple[torch.Tensor, Any, list[torch.Tensor]]] = {}
        self._plans: dict[tuple[tuple[int, ...], tuple[torch.dtype | None, ...]], tuple[Any, ...]] = {}

    def add(self, mark: int, *operands: Any) -> int:
        """Stage an entry of `count` operands; returns the entries staged."""
        marks, slots = self.marks, self.slots
        marks.append(mark)
        for operand in operands:
            kind = type(operand)
            if kind is float or kind is int:
                slots.extend((None, operand))
                continue
            dtype = operand.dtype
            slots.extend((dtype, 0.0))
            group = self._by_dtype.get(dtype)
            if group is None:
                group = self._by_dtype[dtype] = []
            group.append(operand)
            self.tensors.append(operand)
            self.versions.append(operand._version)
        return len(marks)

    def changed(self) -> list[int]:
        """Marks of the entries whose staged tensor was modified in place since it was staged."""
        if [tensor._version for tensor in self.tensors] == self.versions:
            return []
        changed, tensor = [], 0
        for position, kind in enumerate(self.slots[0::2]):
            if kind is not None:
                if self.tensors[tensor]._version != self.versions[tensor]:
                    changed.append(self.marks[position // self.count])
                tensor += 1
        return changed

    def gather(self, prepare: Callable[[list[int]], Any]) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The staged operands as float64 columns of n entries on the device (one per operand of an
        entry), and what `prepare(marks)` made of this pattern's marks (kept with its plan)."""
        slots = self.slots
        key = (tuple(self.marks), tuple(slots[0::2]))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, prepare)
        columns, flat, host, views, prepared = plan
        if 2 * len(self.tensors) != len(slots):  # numbers among them
            numbers = array.array("d", slots[1::2])
            if host is not None:  # the CPU: the tensor is this host memory
                host[:] = numbers
            else:  # one copy, from pinned memory on CUDA (the caching host allocator keeps it until done)
                staged = torch.frombuffer(numbers, dtype=_STAGED)
                flat.copy_(staged.pin_memory() if self.device.type == "cuda" else staged, non_blocking=True)
        for dtype, tensors in self._by_dtype.items():
            torch._foreach_copy_(views[dtype], tensors)
        return columns, prepared

    def _plan(
        self, key: tuple[tuple[int, ...], tuple[torch.dtype | None, ...]], prepare: Callable[[list[int]], Any]
    ) -> tuple[Any, ...]:
        marks, kinds = key
        flat, host, slots = self._block(len(marks))
        views: dict[torch.dtype, list[torch.Tensor]] = {}
        for slot, kind in enumerate(kinds):
            if kind is not None:
                views.setdefault(kind, []).append(slots[slot])
        columns = tuple(flat.view(len(marks), self.count).unbind(1))
        plan = (columns, flat, host, views, prepare(list(marks)))
        if len(self._plans) >= CACHED:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def _block(self, n: int) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
        """The flat float64 tensor of n entries, (on the CPU) the host array it lives in, and a 0-d
        view of every slot; made once per size."""
        found = self._blocks.get(n)
        if found is None:
            if self.device.type == "cpu":
                host: Any = array.array("d", bytes(8 * self.count * n))
                flat = torch.frombuffer(host, dtype=_STAGED)
            else:
                host, flat = None, torch.zeros(self.count * n, dtype=_STAGED, device=self.device)
            found = (flat, host, list(flat.unbind(0)))
            if len(self._blocks) >= CACHED:
                del self._blocks[next(iter(self._blocks))]
            self._blocks[n] = found
        return found

    def clear(self) -> None:
        self.marks.clear()
        self.slots.clear()
        self.tensors.clear()
        self.versions.clear()
        self._by_dtype.clear()
