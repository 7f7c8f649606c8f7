"""A window's results: every leaf of every metric's results in one flat int64 tensor (floats first,
as their float64 bits), turned into Python values with one `tolist()` per part and put back in each
metric's result structure."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["STEPS_POSITION", "ResultPlacement", "Results", "place"]

STEPS_POSITION = -1
"""The position `Results.add` is given for the ranks' steps (not a metric's)."""
_ONE_LEAF = operator.itemgetter(0)


@dataclass(frozen=True, slots=True)
class ResultPlacement:
    """Where each metric's result leaves sit in a window's flat result tensor."""

    pieces: tuple[tuple[list[int], Any, list[tuple]], ...]
    """(metric positions, results builder from leaves, leaf descriptors) per batched group or custom
    metric."""
    floats: int
    """Number of float64 words at the start of the flat tensor (int64 values follow)."""


class Results:
    """Result leaves of a window gathered into one flat int64 tensor (floats first, as float64 bits)."""

    def __init__(self) -> None:
        self._floats: list[torch.Tensor] = []
        self._ints: list[torch.Tensor] = []
        self._counts = [0, 0]
        self._pieces: list[tuple[list[int], Any, list[tuple]]] = []

    def add(self, positions: list[int], results: Any, k: int, *, unbatched: bool = False) -> None:
        """The results of the metrics at `positions`, each tensor leaf batched over them (`k`
        instances along dim 0), or holding one metric's own leaves if `unbatched`."""
        leaves, spec = pytree.tree_flatten(results)
        if unbatched:
            leaves = [leaf.unsqueeze(0) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self._pieces.append((positions, _builder(spec), [self._place(leaf, k) for leaf in leaves]))

    def _place(self, leaf: Any, k: int) -> tuple:
        if not isinstance(leaf, torch.Tensor):
            return ("value", leaf)
        part = 0 if leaf.is_floating_point() else 1
        (self._floats if part == 0 else self._ints).append(leaf.reshape(-1))
        kind = "bool" if leaf.dtype == torch.bool else ("float", "int")[part]
        described = (kind, self._counts[part], leaf.numel() // k, tuple(leaf.shape[1:]))
        self._counts[part] += leaf.numel()
        return described

    def packed(self) -> tuple[torch.Tensor, ResultPlacement]:
        parts = []
        if self._floats:
            parts.append(torch.cat(self._floats).to(torch.float64).view(torch.int64))
        if self._ints:
            parts.append(torch.cat(self._ints).to(torch.int64))
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return flat, ResultPlacement(tuple(self._pieces), self._counts[0])


def _builder(spec: pytree.TreeSpec) -> Callable[[list[Any]], Any]:
    """A fast `tree_unflatten` for the specs results have most: a leaf, or a dict of leaves."""
    if spec.is_leaf():
        return _ONE_LEAF
    # Every child a leaf: one node and one leaf each (TreeSpec.children() is torch >= 2.10 only).
    if spec.type is dict and spec.num_nodes == spec.num_leaves + 1 == spec.num_children + 1:
        keys = tuple(spec.context)
        return lambda leaves: dict(zip(keys, leaves, strict=True))
    return functools.partial(pytree.tree_unflatten, treespec=spec)


def _nested(values: list, shape: tuple[int, ...]) -> Any:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0]
    return [_nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def place(out: list[Any], flat: torch.Tensor, placement: ResultPlacement) -> list[Any] | None:
    """Put each metric's results of host `flat` at its position of `out`, as Python values; returns
    the ranks' steps, if `placement` holds them (at `STEPS_POSITION`)."""
    steps = None
    values = (flat[: placement.floats].view(torch.float64).tolist(), flat[placement.floats :].tolist())
    for positions, build, described in placement.pieces:
        if build is _ONE_LEAF and described[0][0] in ("float", "int") and not described[0][3]:
            start = described[0][1]  # the common case: one scalar per metric
            scalars = values[described[0][0] == "int"][start : start + len(positions)]
            for position, scalar in zip(positions, scalars, strict=True):
                out[position] = scalar
            continue
        per_metric: list[list[Any]] = [[] for _ in positions]
        for leaf in described:
            if leaf[0] == "value":
                for instance in per_metric:
                    instance.append(leaf[1])
                continue
            kind, start, size, shape = leaf
            source = values[0 if kind == "float" else 1]
            for i, instance in enumerate(per_metric):
                chunk = source[start + i * size : start + (i + 1) * size]
                instance.append(_nested([bool(v) for v in chunk] if kind == "bool" else chunk, shape))
        if positions == [STEPS_POSITION]:
            steps = per_metric[0][0]
            continue
        for position, instance in zip(positions, per_metric, strict=True):
            out[position] = build(instance)
    return steps
