"""Pack many small tensors into one flat buffer per (reduce op, dtype, device) bucket.

Pure tensor code: no communication. MIN folds into MAX by negation, so a tree
of float32 states of mixed ops needs at most two buckets (SUM and MAX).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchtelemetry.metric import ReduceOp

__all__ = ["BucketKey", "BucketLayout"]


@dataclass(frozen=True, slots=True, order=True)
class BucketKey:
    """One flat buffer: its reduce op (SUM or MAX), dtype and device."""

    op: str
    dtype: str
    device: str

    @property
    def reduce_op(self) -> ReduceOp:
        return ReduceOp(self.op)


@dataclass(frozen=True, slots=True)
class _Slot:
    name: str
    bucket: BucketKey
    offset: int
    shape: tuple[int, ...]
    negate: bool

    @property
    def numel(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel


class BucketLayout:
    """Where each named tensor lives in the packed buffers; identical on every rank."""

    __slots__ = ("_sizes", "_slots", "signature")

    def __init__(self, entries: Sequence[tuple[str, torch.Tensor, ReduceOp]]) -> None:
        sizes: dict[BucketKey, int] = {}
        slots = []
        for name, tensor, op in entries:
            negate = op is ReduceOp.MIN
            if negate and (
                tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.dtype.is_signed)
            ):
                raise TypeError(f"{name}: MIN reduction needs a signed dtype, got {tensor.dtype}")
            key = BucketKey(
                op=ReduceOp.MAX.value if negate else op.value,
                dtype=str(tensor.dtype),
                device=str(tensor.device),
            )
            offset = sizes.get(key, 0)
            slot = _Slot(name, key, offset, tuple(tensor.shape), negate)
            sizes[key] = offset + slot.numel
            slots.append(slot)
        self._slots = tuple(slots)
        self._sizes = dict(sorted(sizes.items()))
        self.signature = ";".join(
            f"{s.name}:{'min' if s.negate else s.bucket.op}:{s.bucket.dtype}:{list(s.shape)}" for s in slots
        )

    @property
    def buckets(self) -> list[BucketKey]:
        """Bucket keys in the order every rank reduces them."""
        return list(self._sizes)

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self._slots]

    def size(self, key: BucketKey) -> int:
        return self._sizes[key]

    def signature_hash(self) -> int:
        """A stable 60-bit hash of names, ops, dtypes and shapes (devices excluded)."""
        return int(hashlib.sha256(self.signature.encode()).hexdigest()[:15], 16)

    def pack(self, tensors: Sequence[torch.Tensor]) -> dict[BucketKey, torch.Tensor]:
        """New flat buffers holding `tensors` (in entry order); MIN entries negated."""
        if len(tensors) != len(self._slots):
            raise ValueError(f"pack: got {len(tensors)} tensors for a layout of {len(self._slots)}")
        parts: dict[BucketKey, list[torch.Tensor]] = {key: [] for key in self._sizes}
        for slot, tensor in zip(self._slots, tensors, strict=True):
            flat = tensor.reshape(-1)
            parts[slot.bucket].append(flat.neg() if slot.negate else flat)
        return {key: torch.cat(chunks) for key, chunks in parts.items()}

    def unpack(self, buffers: dict[BucketKey, torch.Tensor]) -> list[torch.Tensor]:
        """The entries of `buffers`, in entry order, in their own shapes (MIN entries negated back)."""
        out = []
        for slot in self._slots:
            view = buffers[slot.bucket].narrow(0, slot.offset, slot.numel).view(slot.shape)
            out.append(view.neg() if slot.negate else view)
        return out

    def __len__(self) -> int:
        return len(self._slots)
