"""Pack many small tensors into one flat buffer per (reduce op, dtype, device) bucket.

Pure tensor code: no communication. MIN folds into MAX by negation, so a tree
of float32 states of mixed ops needs at most two buckets (SUM and MAX).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BucketKey", "BucketLayout", "ReduceOp"]


class ReduceOp(enum.Enum):
    """How an accumulator merges across steps and across ranks."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


@dataclass(frozen=True, slots=True, order=True)
class BucketKey:
    """One flat buffer: its reduce op (SUM or MAX), dtype and device."""

    op: str
    dtype: str
    device: str

    @property
    def reduce_op(self) -> ReduceOp:
        return ReduceOp(self.op)


def _negate_(tensor: torch.Tensor) -> None:
    """Reverse the order of `tensor`'s values in place: `-x` for floats, `~x` for integers.

    `~x == -x - 1` reverses the order of two's complement integers without the
    overflow of `-x` at the dtype's minimum.
    """
    if tensor.is_floating_point():
        tensor.neg_()
    else:
        tensor.bitwise_not_()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


@dataclass(frozen=True, slots=True)
class _Bucket:
    entries: tuple[int, ...]
    """Entry indices in buffer order: MIN entries (stored negated) come last."""
    sizes: tuple[int, ...]
    negate_from: int
    """Offset where the negated (MIN) entries start; the buffer size if there are none."""


class BucketLayout:
    """Where each named tensor lives in the packed buffers; identical on every rank.

    `configs` (owner name -> attribute -> value, e.g. `{"train/hist": {"bins": [1.0, 2.0]}}`) is
    what gives the states their meaning besides names, ops, dtypes and shapes: it rides in the
    signature, so ranks that agree on the shapes but not on, say, histogram bins do not agree.
    """

    __slots__ = (
        "_buckets",
        "_hash",
        "_negated",
        "_offsets",
        "_shapes",
        "_states",
        "configs",
        "names",
        "signature",
    )

    def __init__(
        self,
        entries: Sequence[tuple[str, torch.Tensor, ReduceOp]],
        configs: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        grouped: dict[BucketKey, tuple[list[int], list[int]]] = {}
        signature = []
        for index, (name, tensor, op) in enumerate(entries):
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
            grouped.setdefault(key, ([], []))[1 if negate else 0].append(index)
            signature.append((name, f"{op.value}:{tensor.dtype}:{list(tensor.shape)}"))
        self.names = [name for name, _, _ in entries]
        self._shapes = [tuple(tensor.shape) for _, tensor, _ in entries]
        self._buckets: dict[BucketKey, _Bucket] = {}
        for key in sorted(grouped):
            kept, negated = grouped[key]
            sizes = tuple(entries[i][1].numel() for i in (*kept, *negated))
            self._buckets[key] = _Bucket(
                entries=(*kept, *negated), sizes=sizes, negate_from=sum(sizes[: len(kept)])
            )
        self._negated = [
            (key, bucket.negate_from)
            for key, bucket in self._buckets.items()
            if bucket.negate_from < sum(bucket.sizes)
        ]
        """The buckets holding MIN entries, and where they start."""
        self._offsets: dict[int, tuple[BucketKey, int]] = {}
        for key, bucket in self._buckets.items():
            offset = 0
            for index, size in zip(bucket.entries, bucket.sizes, strict=True):
                self._offsets[index] = (key, offset)
                offset += size
        self.configs = tuple(
            (owner, attr, repr(value))
            for owner, config in (configs or {}).items()
            for attr, value in sorted(config.items())
        )
        """(owner, attribute, repr of its value) for every entry of `configs`."""
        self._states = signature
        self.signature = ";".join(
            [f"{name}:{state}" for name, state in signature]
            + [f"{owner}[{attr}]={value}" for owner, attr, value in self.configs]
        )
        self._hash = int(hashlib.sha256(self.signature.encode()).hexdigest()[:15], 16)

    @property
    def buckets(self) -> list[BucketKey]:
        """Bucket keys in the order every rank reduces them."""
        return list(self._buckets)

    def size(self, key: BucketKey) -> int:
        return sum(self._buckets[key].sizes)

    def offset(self, index: int) -> tuple[BucketKey, int]:
        """Entry `index`'s bucket and its offset in that bucket's buffer (in elements)."""
        return self._offsets[index]

    def shape(self, index: int) -> tuple[int, ...]:
        return self._shapes[index]

    def signature_hash(self) -> int:
        """A stable 60-bit hash of names, ops, dtypes, shapes and configs (devices excluded)."""
        return self._hash

    def described(self) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        """The signature as data, to say what differs between ranks: (name, `op:dtype:shape`) per
        entry, and `configs`."""
        return list(self._states), list(self.configs)

    def storage(self, tensors: Sequence[torch.Tensor]) -> dict[BucketKey, torch.Tensor]:
        """New flat buffers holding `tensors` as they are, laid out as `pack` lays them out.

        With each entry then kept in its view (`views`), a pack is one copy per bucket instead of
        one per entry.
        """
        if len(tensors) != len(self._shapes):
            raise ValueError(f"pack: got {len(tensors)} tensors for a layout of {len(self._shapes)}")
        return {
            key: torch.cat([_flat(tensors[i]) for i in bucket.entries])
            for key, bucket in self._buckets.items()
        }

    def pack_into(self, tensors: Sequence[torch.Tensor], buffers: dict[BucketKey, torch.Tensor]) -> None:
        """`pack` into existing `buffers` (one `cat` per bucket); MIN entries negated."""
        for key, bucket in self._buckets.items():
            torch.cat([_flat(tensors[i]) for i in bucket.entries], out=buffers[key])
        self.negate_min_(buffers)

    def views(self, buffers: dict[BucketKey, torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's view into `buffers`, in entry order and in its own shape (no negation)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self._shapes)
        for key, bucket in self._buckets.items():
            for index, piece in zip(bucket.entries, buffers[key].split(bucket.sizes), strict=True):
                out[index] = piece.view(self._shapes[index])
        return out

    def pack(self, tensors: Sequence[torch.Tensor]) -> dict[BucketKey, torch.Tensor]:
        """New flat buffers holding `tensors` (in entry order); MIN entries negated."""
        return self.negate_min_(self.storage(tensors))

    def negate_min_(self, buffers: dict[BucketKey, torch.Tensor]) -> dict[BucketKey, torch.Tensor]:
        """Negate (or negate back), in place, the MIN part at the end of each bucket; returns `buffers`."""
        for key, negate_from in self._negated:
            _negate_(buffers[key][negate_from:])
        return buffers

    def unpack(self, buffers: dict[BucketKey, torch.Tensor]) -> list[torch.Tensor]:
        """The entries of `buffers`, in entry order, in their own shapes (MIN entries negated back).

        Entries are views of `buffers` except MIN entries, which are new tensors;
        `buffers` are left unchanged.
        """
        restored = {key: buffers[key] for key in self._buckets}
        for key, _ in self._negated:
            restored[key] = restored[key].clone()
        return self.views(self.negate_min_(restored))

    def __len__(self) -> int:
        return len(self._shapes)
