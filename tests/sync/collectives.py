"""Count calls to torch.distributed collectives (used inside rank functions and by bench/)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "barrier",
)


class CollectiveCounter:
    """Wraps the torch.distributed collectives; counts outermost calls by name while `counting()`.

    A collective that calls another (all_gather_object -> all_gather) counts once.
    """

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._active = False
        self._depth = 0
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @contextmanager
    def counting(self) -> Iterator[collections.Counter[str]]:
        """Count the collectives issued in the block (a fresh Counter per block)."""
        self.calls = collections.Counter()
        self._active = True
        try:
            yield self.calls
        finally:
            self._active = False

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._active and self._depth == 0:
                self.calls[name] += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted
