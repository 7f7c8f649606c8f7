"""A window's results: every leaf of every metric's results in one flat int64 tensor (floats first,
as their float64 bits), turned into Python values with one `tolist()` per part and put back in each
metric's result structure.

Where each leaf sits (the placement) depends only on what the results look like: their structure
and each tensor leaf's dtype and shape, the same window after window. `Results.packed` reuses the
placement of the window before when its results look alike, so a window's host work is the tensor
ops and one pass over the values; on the CPU it reuses that window's flat tensor too, the leaves
copied into it by one `_foreach_copy_` (each op hands the GIL to the training thread and back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch.utils import _pytree as pytree

__all__ = ["STEPS_POSITION", "Packed", "ResultPlacement", "Results", "place"]

STEPS_POSITION = -1
"""The position `Results.add` is given for the ranks' steps (not a metric's)."""

Structure: TypeAlias = "tuple[Any, ...] | pytree.TreeSpec | None"
"""How a result's leaves become the result again: None for a single leaf, the keys of a dict of
leaves, else the result's TreeSpec."""

_TENSOR = frozenset({torch.Tensor})


@dataclass(frozen=True, slots=True)
class ResultPlacement:
    """Where each metric's result leaves sit in a window's flat result tensor."""

    pieces: tuple[tuple[list[int], Structure, tuple[tuple, ...], tuple[int, int] | None], ...]
    """(metric positions, their results' `Structure`, leaf descriptors, and `(part, start)` when each
    metric's result is one scalar) per batched group or custom metric."""
    floats: int
    """Number of float64 words at the start of the flat tensor (int64 values follow)."""
    signature: tuple | None = None
    """What the results placed looked like (positions, structure, and each tensor leaf's dtype and
    shape); None when a leaf is not a tensor (its value is part of the placement)."""


@dataclass(frozen=True, slots=True)
class Packed:
    """A window's results packed: the flat tensor and its placement."""

    flat: torch.Tensor
    placement: ResultPlacement
    targets: list[torch.Tensor] | None = None
    """On the CPU, a view of `flat` shaped as each result leaf, floats first (None on a device, where a
    copy per leaf would be a launch each, and for results whose values are part of the placement):
    a later window whose results look alike is copied into them, and `flat` is reused."""
    parts: tuple[torch.Tensor, torch.Tensor] | None = None
    """With `targets`: `flat`'s floats (as float64) and ints, as `place` reads them."""


def _flat(leaf: torch.Tensor) -> torch.Tensor:
    return leaf if leaf.dim() == 1 else leaf.reshape(-1)  # a view is an op too


class Results:
    """Result leaves of a window gathered into one flat int64 tensor (floats first, as float64 bits)."""

    def __init__(self) -> None:
        self._floats: list[torch.Tensor] = []
        self._ints: list[torch.Tensor] = []
        self._added: list[tuple[list[int], Structure, list[Any], int, bool]] = []
        self._signature: list[Any] | None = []

    def add(self, positions: list[int], results: Any, k: int, *, unbatched: bool = False) -> None:
        """The results of the metrics at `positions`, each tensor leaf batched over them (`k`
        instances along dim 0), or holding one metric's own leaves if `unbatched`."""
        structure, leaves = _flattened(results)
        self._added.append((positions, structure, leaves, k, unbatched))
        signature = self._signature
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                (self._floats if leaf.is_floating_point() else self._ints).append(leaf)
                if signature is not None:
                    signature.append((leaf.dtype, leaf.shape))
            else:
                self._signature = signature = None
        if signature is not None:
            signature.append((positions, structure, k, unbatched))

    def packed(self, previous: Packed | None = None) -> Packed:
        """The flat tensor and its placement: `previous`'s placement when the results look as they did
        there, and on the CPU `previous`'s flat tensor itself, the leaves copied into it in one op."""
        signature = None if self._signature is None else tuple(self._signature)
        alike = previous is not None and signature is not None and previous.placement.signature == signature
        if alike and previous.targets is not None:
            if previous.targets:
                torch._foreach_copy_(previous.targets, self._floats + self._ints)
            return previous
        parts = []
        if self._floats:
            parts.append(
                torch.cat([_flat(leaf) for leaf in self._floats]).to(torch.float64).view(torch.int64)
            )
        if self._ints:
            parts.append(torch.cat([_flat(leaf) for leaf in self._ints]).to(torch.int64))
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        placement = previous.placement if alike else self._placement(signature)
        if flat.device.type != "cpu" or signature is None:
            return Packed(flat, placement)
        floats, ints = _parts(flat, placement)
        targets, starts = [], [0, 0]
        for part, (leaves, values) in enumerate(((self._floats, floats), (self._ints, ints))):
            for leaf in leaves:
                start, starts[part] = starts[part], starts[part] + leaf.numel()
                targets.append(values[start : starts[part]].view(leaf.shape))
        return Packed(flat, placement, targets, (floats, ints))

    def _placement(self, signature: tuple | None) -> ResultPlacement:
        counts = [0, 0]
        pieces = []
        for positions, structure, leaves, k, unbatched in self._added:
            described = []
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    described.append(("value", leaf))
                    continue
                part = 0 if leaf.is_floating_point() else 1
                kind = "bool" if leaf.dtype == torch.bool else ("float", "int")[part]
                shape = tuple(leaf.shape) if unbatched else tuple(leaf.shape[1:])
                described.append((kind, counts[part], leaf.numel() // k, shape))
                counts[part] += leaf.numel()
            first = described[0] if len(described) == 1 else None
            scalar = (
                (first[0] == "int", first[1])
                if structure is None and first is not None and first[0] in ("float", "int") and not first[3]
                else None
            )
            pieces.append((positions, structure, tuple(described), scalar))
        return ResultPlacement(tuple(pieces), counts[0], signature)


def _flattened(results: Any) -> tuple[Structure, list[Any]]:
    """`results`' structure and leaves, as `pytree.tree_flatten` orders them (a tensor and a dict of
    tensors, what results are most, without it)."""
    if isinstance(results, torch.Tensor):
        return None, [results]
    if type(results) is dict and _TENSOR.issuperset(map(type, results.values())):
        return tuple(results), list(results.values())
    leaves, spec = pytree.tree_flatten(results)
    return _structure(spec), leaves


def _structure(spec: pytree.TreeSpec) -> Structure:
    """The `Structure` of results flattened to `spec` (read with the TreeSpec API of torch 2.5)."""
    if spec.is_leaf():
        return None
    # Every child a leaf: one node and one leaf each (TreeSpec.children() is torch >= 2.10 only).
    if spec.type is dict and spec.num_nodes == spec.num_leaves + 1 == spec.num_children + 1:
        return tuple(spec.context)
    return spec


def _built(structure: Structure, leaves: list[Any]) -> Any:
    """The result of `structure` from its `leaves`."""
    if structure is None:
        return leaves[0]
    if type(structure) is tuple:
        return dict(zip(structure, leaves, strict=True))
    return pytree.tree_unflatten(leaves, structure)


def _nested(values: list, shape: tuple[int, ...]) -> Any:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0]
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _parts(flat: torch.Tensor, placement: ResultPlacement) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat`'s floats (as float64) and ints."""
    return flat[: placement.floats].view(torch.float64), flat[placement.floats :]


def place(
    out: list[Any],
    flat: torch.Tensor,
    placement: ResultPlacement,
    parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Any] | None:
    """Put each metric's results of host `flat` (`parts`: its floats and ints, if at hand) at its
    position of `out`, as Python values; returns the ranks' steps, if `placement` holds them (at
    `STEPS_POSITION`)."""
    steps = None
    floats, ints = _parts(flat, placement) if parts is None else parts
    values = (floats.tolist(), ints.tolist())
    for positions, structure, described, scalar in placement.pieces:
        if scalar is not None:  # the common case: one scalar per metric
            part, start = scalar
            for position, value in zip(positions, values[part][start : start + len(positions)], strict=True):
                out[position] = value
            continue
        per_metric: list[list[Any]] = [[] for _ in positions]
        for leaf in described:
            if leaf[0] == "value":
                for instance in per_metric:
                    instance.append(leaf[1])
                continue
            kind, start, size, shape = leaf
            source = values[0 if kind == "float" else 1]
            for instance in per_metric:
                chunk = source[start : start + size]
                start += size
                if kind == "bool":
                    chunk = list(map(bool, chunk))
                instance.append(chunk if len(shape) == 1 else _nested(chunk, shape))
        if positions == [STEPS_POSITION]:
            steps = per_metric[0][0]
            continue
        for position, instance in zip(positions, per_metric, strict=True):
            out[position] = _built(structure, instance)
    return steps
