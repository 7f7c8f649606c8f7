"""Turn a PyTree of tensors into a PyTree of Python scalars."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["to_python"]


def _leaf_to_python(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf.item() if leaf.dim() == 0 else leaf.tolist()
    return leaf


def to_python(tree: Any) -> Any:
    """Same structure, every tensor leaf as a Python scalar (0-d) or nested list."""
    return pytree.tree_map(_leaf_to_python, tree)
