"""The windows a collector scheduled and nobody collected yet, oldest first."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from torchtelemetry.collect._transports import CollectionError

__all__ = ["PendingWindow", "PendingWindows"]


@dataclass(slots=True)
class PendingWindow:
    index: int
    future: Future
    then: bool
    """Whether the future holds what a `then` callback returned (not the metrics' results)."""


class PendingWindows:
    """Scheduled windows in order: the worker completes them in order, the training thread collects
    the oldest."""

    def __init__(self) -> None:
        self._windows: collections.deque[PendingWindow] = collections.deque()

    def __len__(self) -> int:
        return len(self._windows)

    def __iter__(self) -> Iterator[PendingWindow]:
        return iter(self._windows)

    def add(self, window: PendingWindow) -> None:
        self._windows.append(window)

    def ready(self) -> bool:
        """Whether the oldest window can be collected without waiting."""
        return bool(self._windows) and self._windows[0].future.done()

    def next(self, op: str, timeout: float, timeout_s: float) -> tuple[PendingWindow, Any]:
        """Wait (at most `timeout` s) for the oldest window and take it, with what its future holds;
        a `CollectionError` (naming `op` and the collector's `timeout_s`) if it failed or is late."""
        if not self._windows:
            raise RuntimeError(
                f"AsyncMetricCollector.{op}: nothing scheduled; call schedule_collection() first"
            )
        window = self._windows[0]
        try:
            results = window.future.result(timeout=timeout)
        except FutureTimeout:
            raise CollectionError(
                f"AsyncMetricCollector.{op}: window {window.index} did not complete in {timeout:.1f}s; "
                f"a rank may have died or not called schedule_collection() within timeout_s="
                f"{timeout_s:g}s, or be far behind"
            ) from None
        except Exception as error:
            self._windows.popleft()
            reason = str(error) if isinstance(error, CollectionError) else f"{type(error).__name__}: {error}"
            raise CollectionError(f"AsyncMetricCollector.{op}: window {window.index} failed: {reason}") from (
                error.__cause__ if isinstance(error, CollectionError) else error
            )
        self._windows.popleft()
        return window, results

    def finish(self, deadline: float) -> bool:
        """Wait for every window until the `time.monotonic()` `deadline`, then forget them (results
        not collected are discarded); False if one was still running at the deadline."""
        finished = True
        for window in self._windows:
            try:
                window.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                finished = False
                break
            except Exception:  # a failed window is discarded like an uncollected one
                continue
        self._windows.clear()
        return finished
