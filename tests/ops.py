"""Counting the torch ops a block dispatches, to assert work that does not grow with the metrics."""

from __future__ import annotations

import collections
from typing import Any

# The one import of a private module of torch (tests/test_imports.py allows it here alone): torch
# 2.13 has no public dispatch mode, the only way to see the aten ops a block runs.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "TorchDispatchMode"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched in this thread (dispatch modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
