"""`StagedRows`: the staged entries of one buffer, their operands kept by position until a flush
gathers them into float64 rows on the buffer's device."""

from __future__ import annotations

import array
from typing import Any

import torch

__all__ = ["StagedRows"]

CACHED_SIZES = 64
"""Row tensors kept per size (distinct numbers of updates staged between flushes)."""
_STAGED = torch.float64


class StagedRows:
    """Entries staged for one buffer: each its offset in the buffer and one operand per row (`count`
    rows), a Python number (kept on the host) or a 0-d tensor (copied at the flush: one
    `_foreach_copy_` per dtype into its float64 slot)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.count = count
        self.device = device
        self.offsets: list[int] = []
        """Each entry's offset in the buffer."""
        self._host: list[list[Any]] = [[] for _ in range(count)]
        self._first = self._host[0]
        self._numbers = False
        self._tensors: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        self.versions: list[tuple[torch.Tensor, int, int]] = []
        """(tensor, its version when staged, position): a tensor changed in place since is caught."""
        self._buffers: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor, Any, list[torch.Tensor]]] = {}

    def add(self, offset: int, first: Any, second: Any = None) -> None:
        """Stage an entry at buffer `offset`: `first` in row 0 and (two rows) `second` in row 1."""
        position = len(self.offsets)
        self.offsets.append(offset)
        kind = type(first)
        if kind is float or kind is int:
            self._first.append(first)
            self._numbers = True
        else:
            self._first.append(0.0)
            self._tensor(first, position)
        if self.count == 1:
            return
        kind = type(second)
        if kind is float or kind is int:
            self._host[1].append(second)
            self._numbers = True
        else:
            self._host[1].append(0.0)
            self._tensor(second, 1 << 32 | position)

    def _tensor(self, operand: torch.Tensor, slot: int) -> None:
        group = self._tensors.get(operand.dtype)
        if group is None:
            group = self._tensors[operand.dtype] = ([], [])
        group[0].append(slot)
        group[1].append(operand)
        self.versions.append((operand, operand._version, slot & 0xFFFFFFFF))

    def __len__(self) -> int:
        return len(self.offsets)

    def changed(self) -> list[int]:
        """Offsets of the entries whose staged tensor was modified in place since it was staged."""
        return [
            self.offsets[position]
            for tensor, version, position in self.versions
            if tensor._version != version
        ]

    def gather(self) -> tuple[torch.Tensor, ...]:
        """The staged operands as float64 tensors of n entries on the device, one per row."""
        n = len(self.offsets)
        rows, flat, host, views = self._buffer(n)
        if self._numbers:
            numbers = array.array("d", self._first if self.count == 1 else self._first + self._host[1])
            if host is not None:  # the CPU: the tensor is this host memory
                host[:] = numbers
            else:  # one copy, from pinned memory on CUDA (the caching host allocator keeps it until done)
                staged = torch.frombuffer(numbers, dtype=_STAGED)
                flat.copy_(staged.pin_memory() if self.device.type == "cuda" else staged, non_blocking=True)
        for slots, operands in self._tensors.values():
            torch._foreach_copy_([views[(slot >> 32) * n + (slot & 0xFFFFFFFF)] for slot in slots], operands)
        return rows

    def _buffer(self, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Any, list[torch.Tensor]]:
        """The rows for `n` positions (views of one flat tensor), that tensor, (on the CPU) the host
        array it lives in and a 0-d view of every slot; made once per size."""
        found = self._buffers.get(n)
        if found is None:
            if self.device.type == "cpu":
                host: Any = array.array("d", bytes(8 * self.count * n))
                flat = torch.frombuffer(host, dtype=_STAGED)
            else:
                host, flat = None, torch.zeros(self.count * n, dtype=_STAGED, device=self.device)
            found = (tuple(flat.split(n)), flat, host, list(flat.unbind(0)))
            if len(self._buffers) >= CACHED_SIZES:
                del self._buffers[next(iter(self._buffers))]
            self._buffers[n] = found
        return found

    def clear(self) -> None:
        self.offsets.clear()
        for row in self._host:
            row.clear()
        self._numbers = False
        self._tensors.clear()
        self.versions.clear()
