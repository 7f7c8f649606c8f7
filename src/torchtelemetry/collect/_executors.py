"""The collector's worker thread: runs the part of each collection the training thread hands it."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["ThreadExecutor"]


class ThreadExecutor:
    """One named daemon thread running submitted calls in order, after `initializer` (e.g. setting
    the thread's CUDA device).

    Not a `ThreadPoolExecutor`: its `submit` takes a semaphore through a Python
    `Condition`, during which a worker that just woke up takes the GIL, and the
    training thread waited ~100 µs per submit behind it (2 gloo ranks on 2 cores).
    Here `submit` is a `Future` and one `SimpleQueue.put`.
    """

    def __init__(self, name: str, *, initializer: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(initializer,), name=name, daemon=True)
        self._thread.start()

    def _run(self, initializer: Callable[[], None] | None) -> None:
        failure: BaseException | None = None
        if initializer is not None:
            try:
                initializer()
            except BaseException as error:  # every call then fails with it
                failure = error
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            del item  # hold nothing of a finished window while waiting for the next
            if future.set_running_or_notify_cancel():
                try:
                    if failure is not None:
                        raise failure
                    future.set_result(fn(*args))
                except BaseException as error:  # the caller sees it from future.result()
                    future.set_exception(error)
            del future, fn, args

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the worker after everything submitted before."""
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, *, wait: bool) -> None:
        """Cancel the calls not started yet and stop the thread (joining it if `wait`)."""
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        self._queue.put(None)
        if wait:
            self._thread.join()
