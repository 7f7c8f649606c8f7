"""Count or record calls to torch.distributed collectives, and the bytes a process writes to its
sockets (used inside rank functions and by bench/)."""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch.distributed as dist

GLOO_HEADER_BYTES = 48
"""gloo's TCP transport writes every message with a header of this many bytes (torch 2.13)."""

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


def process_writes() -> tuple[int, int]:
    """`(bytes, calls)` this process has written so far (`wchar`, `syscw` of /proc/self/io): files,
    pipes and sockets; between two reads around collectives alone, what gloo sent. OSError where
    the kernel keeps no I/O accounting."""
    with open("/proc/self/io") as io:
        fields = dict(line.split(":") for line in io.read().splitlines())
    return int(fields["wchar"]), int(fields["syscw"])


@dataclass(frozen=True)
class Traffic:
    """What one repeat of a block cost this process, on average over the repeats."""

    collectives: float
    writes: float
    """Write calls (gloo's TCP ring: 6 per ring step)."""
    payload: float
    """Bytes written less gloo's message headers: the data this rank sent."""


def measure_traffic(counter: CollectiveCounter, block: Callable[[], None], repeats: int) -> Traffic:
    """Run `block` `repeats` times; the collectives it issued and what the process wrote, per repeat."""
    written, calls = process_writes()
    with counter.counting() as counted:
        for _ in range(repeats):
            block()
    written_after, calls_after = process_writes()
    writes = (calls_after - calls) / repeats
    return Traffic(
        collectives=sum(counted.values()) / repeats,
        writes=writes,
        payload=(written_after - written) / repeats - GLOO_HEADER_BYTES * writes,
    )


class Call(NamedTuple):
    """One collective: its name, the `group=` it was given, that group's backend then, the thread."""

    name: str
    group: Any
    backend: str
    thread: str


class CollectiveRecorder:
    """`with CollectiveRecorder() as calls:` records every torch.distributed collective issued in the
    block, from any thread, as a `Call`; a collective that calls another counts once.

    Wraps the functions both where user code reaches them (`torch.distributed.<name>`) and where
    torch.distributed's own helpers do (`torch.distributed.distributed_c10d.<name>`).
    """

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._inside = threading.local()
        self._originals: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> list[Call]:
        from torch.distributed import distributed_c10d

        for module in (dist, distributed_c10d):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    self._originals.append((module, name, original))
                    setattr(module, name, self._wrap(name, original))
        return self.calls

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0) == 0:
                group = kwargs.get("group")
                backend = str(dist.get_backend(group)) if dist.is_initialized() else ""
                self.calls.append(Call(name, group, backend, threading.current_thread().name))
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return recorded
