"""`StagedRows`: the operands of staged updates, kept by position until a flush gathers them."""

from __future__ import annotations

import array
from typing import Any

import torch

__all__ = ["StagedRows"]

CACHED_SIZES = 64
"""Row tensors kept per size (distinct numbers of updates staged between flushes)."""
_STAGED = torch.float64


class StagedRows:
    """Float64 operands staged by position, in `count` aligned rows: Python numbers on the host,
    0-d tensors copied at the flush (one `_foreach_copy_` per dtype)."""

    def __init__(self, count: int, device: torch.device) -> None:
        self.count = count
        self.device = device
        self.host: list[list[float]] = [[] for _ in range(count)]
        self._numbers = False
        self._tensors: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        self.versions: list[tuple[torch.Tensor, int, int]] = []
        """(tensor, its version when staged, position): a tensor changed in place since is caught."""
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, Any, list[torch.Tensor]]] = {}

    def put(self, row: int, operand: torch.Tensor | float) -> None:
        """Stage `operand` at the next position of `row` (rows are filled in step)."""
        position = len(self.host[row])
        if type(operand) is float or type(operand) is int:
            self.host[row].append(float(operand))
            self._numbers = True
            return
        assert isinstance(operand, torch.Tensor)
        self.host[row].append(0.0)
        group = self._tensors.get(operand.dtype)
        if group is None:
            group = self._tensors[operand.dtype] = ([], [])
        group[0].append(row << 32 | position)
        group[1].append(operand)
        self.versions.append((operand, operand._version, position))

    def __len__(self) -> int:
        return len(self.host[0])

    def changed(self) -> list[int]:
        """Positions whose staged tensor was modified in place since it was staged."""
        return [position for tensor, version, position in self.versions if tensor._version != version]

    def gather(self) -> torch.Tensor:
        """The staged operands as a float64 tensor of (`count`, n) on the device ((n,) for one row)."""
        n = len(self)
        tensor, flat, host, views = self._buffer(n)
        if self._numbers:
            numbers = [number for row in self.host for number in row]
            if host is not None:  # the CPU: the tensor is this host memory
                host[:] = array.array("d", numbers)
            else:  # one copy, from pinned memory on CUDA (the caching host allocator keeps it until done)
                staged = torch.tensor(numbers, dtype=_STAGED)
                flat.copy_(staged.pin_memory() if self.device.type == "cuda" else staged, non_blocking=True)
        for slots, operands in self._tensors.values():
            torch._foreach_copy_([views[(slot >> 32) * n + (slot & 0xFFFFFFFF)] for slot in slots], operands)
        return tensor

    def _buffer(self, n: int) -> tuple[torch.Tensor, torch.Tensor, Any, list[torch.Tensor]]:
        """The rows' tensor for `n` positions, flat, (on the CPU) the host array it lives in and a
        0-d view of every slot; made once per size."""
        found = self._buffers.get(n)
        if found is None:
            shape = (self.count, n) if self.count > 1 else (n,)
            if self.device.type == "cpu":
                host: Any = array.array("d", bytes(8 * self.count * n))
                tensor = torch.frombuffer(host, dtype=_STAGED).view(shape)
            else:
                host, tensor = None, torch.zeros(shape, dtype=_STAGED, device=self.device)
            flat = tensor.view(-1)
            found = (tensor, flat, host, list(flat.unbind(0)))
            if len(self._buffers) >= CACHED_SIZES:
                del self._buffers[next(iter(self._buffers))]
            self._buffers[n] = found
        return found

    def clear(self) -> None:
        for row in self.host:
            row.clear()
        self._numbers = False
        self._tensors.clear()
        self.versions.clear()
