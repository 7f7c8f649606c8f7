"""Where a collection runs: a worker thread, plus a side CUDA stream on GPUs.

Everything a collection does (sync, compute, results) is shared code in the
collector; an executor only fences the snapshot, enters the stream and moves
results to host memory. The CPU executor is the CUDA one minus the device work.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["CudaExecutor", "ThreadExecutor", "make_executor"]


class ThreadExecutor:
    """One named daemon thread running submitted calls in order; results are plain host tensors.

    Not a `ThreadPoolExecutor`: its `submit` takes a semaphore through a Python
    `Condition`, during which a worker that just woke up takes the GIL, and the
    training thread waited ~100 µs per submit behind it (2 gloo ranks on 2 cores).
    Here `submit` is a `Future` and one `SimpleQueue.put`.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._init_thread()
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            del item  # hold nothing of a finished window while waiting for the next
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # the caller sees it from future.result()
                    future.set_exception(error)
            del future, fn, args

    def _init_thread(self) -> None:
        """Per-thread set-up (the CUDA executor selects the device)."""

    def fence(self) -> Any:
        """Mark the snapshot's position in the training stream (nothing to do on CPU)."""
        return None

    @contextlib.contextmanager
    def running_after(self, fence: Any, inputs: Iterable[torch.Tensor]) -> Iterator[None]:
        """Context in which the worker's device work on `inputs` runs, ordered after `fence`."""
        yield

    def to_host(self, tree: Any) -> tuple[Any, Any]:
        """Results on the host, and a handle `wait_host` waits on before they may be read."""
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, tree), None

    def host_ready(self, handle: Any) -> bool:
        return True

    def wait_host(self, handle: Any) -> None:
        """Wait until the host copies behind `handle` are complete."""

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


class CudaExecutor(ThreadExecutor):
    """The worker issues onto a side stream that waits on an event recorded after the snapshot.

    The host never waits at schedule time: the snapshot is ordered by an event,
    the collectives and compute run on the side stream, and results land in
    pinned host memory with a second event that `wait_host` synchronizes on.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        super().__init__(name)

    def _init_thread(self) -> None:
        torch.cuda.set_device(self._device)

    def fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    @contextlib.contextmanager
    def running_after(self, fence: torch.cuda.Event, inputs: Iterable[torch.Tensor]) -> Iterator[None]:
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(fence)
            for tensor in inputs:
                # Allocated on the training stream, used here: keep the allocator from reusing it early.
                tensor.record_stream(self._stream)
            yield

    def to_host(self, tree: Any) -> tuple[Any, torch.cuda.Event]:
        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
            return host

        host_tree = pytree.tree_map_only(torch.Tensor, copy, tree)
        done = torch.cuda.Event()
        done.record(self._stream)
        return host_tree, done

    def host_ready(self, handle: torch.cuda.Event) -> bool:
        return handle.query()

    def wait_host(self, handle: torch.cuda.Event) -> None:
        handle.synchronize()


def make_executor(device: torch.device, name: str) -> ThreadExecutor:
    """The executor for metrics living on `device`."""
    if device.type == "cuda":
        return CudaExecutor(name, device)
    return ThreadExecutor(name)
