"""`AsyncMetricCollector`: snapshot on the training thread, sync and compute off it."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from torchtelemetry._process import check_same_process, current_pid
from torchtelemetry.collect._device import DeviceTransport
from torchtelemetry.collect._executors import ThreadExecutor
from torchtelemetry.collect._pending import PendingWindow, PendingWindows
from torchtelemetry.collect._transports import (
    DEFAULT_MAX_PENDING,
    DEFAULT_TIMEOUT_S,
    BoundStorage,
    CollectionError,
    HostTransport,
    Transport,
    TransportName,
    check_collection_limits,
    choose_transport,
    dedicated_gloo_group,
)
from torchtelemetry.metric import MetricBinding, metric_leaves
from torchtelemetry.sync import GroupLike, forget_group, group_world_size, resolve_group

__all__ = ["AsyncMetricCollector", "CollectionError"]

_THREAD_PREFIX = "torchtelemetry-collector"
# Process-global: thread names are unique within a process, so the collectors number theirs per process.
_collector_ids = itertools.count()


def _then(finish: Callable[[], list[Any]], then: Callable[[list[Any]], Any]) -> Any:
    return then(finish())


def _set_device(device: torch.device) -> None:
    torch.cuda.set_device(device)


class AsyncMetricCollector:
    """Collect a PyTree of Metrics without stalling the training loop.

    `schedule_collection()` snapshots the local state (one copy per bucket into a
    slot allocated at `bind()`) and resets the metrics in place (updates made
    afterwards land in the next window); the window is then reduced across ranks
    (one collective while the payload is small) and computed in batches, and
    `collect_results()` returns the oldest window's results as Python scalars, in
    the structure of the metrics' `compute()` outputs.

    Transports (docs/collection.md):

    - `"host"`: the slot is host memory (pinned, filled by a non-blocking copy on CUDA); a
      worker thread reduces it on a gloo group of the same ranks and computes on the host.
    - `"device"`: the training thread itself issues the collective inside
      `schedule_collection()`, on `group` and asynchronously; on CUDA the compute and one
      packed copy of the results follow on a side stream, and the worker only waits.
    - `"auto"` (default): `"host"` for CPU metrics and for packed states up to
      `HOST_TRANSPORT_LIMIT_BYTES` (1 MiB), else `"device"`.

    No collective on an accelerator group ever leaves the thread that calls
    `schedule_collection()`.

    Args:
        metrics: a Metric or a PyTree (dict, list, nested) of Metrics.
        group: ranks to reduce over (ProcessGroup, DeviceMesh, (mesh, dim) or None).
        timeout_s: bound on one collection; a rank that never schedules, or
            dies, makes `collect_results` raise within it instead of hanging.
        max_pending: scheduled windows allowed before `collect_results` must be called; the ring
            of slots allocated at `bind()` has this many (default `DEFAULT_MAX_PENDING`, which
            `TelemetryConfig.max_pending` shares).
        device: where `bind()` moves the metrics (e.g. the rank's GPU); None keeps them where
            they are.
        transport: `"host"`, `"device"` or `"auto"`, as above.
    """

    def __init__(
        self,
        metrics: Any,
        group: GroupLike = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        device: torch.device | str | None = None,
        transport: TransportName = "auto",
    ) -> None:
        check_collection_limits("AsyncMetricCollector: ", timeout_s=timeout_s, max_pending=max_pending)
        if transport not in ("host", "device", "auto"):
            raise ValueError(
                f"AsyncMetricCollector: transport must be 'host', 'device' or 'auto', got {transport!r}"
            )
        self._metrics = metrics
        self._named = metric_leaves(metrics, op="AsyncMetricCollector")
        self._spec = pytree.tree_structure(metrics)
        self._group = group
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.device = None if device is None else torch.device(device)
        self.transport: TransportName = transport
        self._storage: BoundStorage | None = None
        self._transport: Transport | None = None
        self._executor: ThreadExecutor | None = None
        self._bound_group: dist.ProcessGroup | None = None
        """The group windows are reduced over: a gloo group of this collector's own (host transport),
        or the resolved `group` itself (device transport)."""
        self._dedicated_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._binding = MetricBinding(self)
        self._pending = PendingWindows()
        self._windows = itertools.count()
        self._state = "new"
        self._pid = current_pid()

    # -- life cycle -------------------------------------------------------------------

    def bind(self) -> AsyncMetricCollector:
        """Claim the metrics; prepare the worker thread, the transport (its ring of slots) and the group.

        Collective across the ranks of `group` when torch.distributed is initialized: creates the
        collector's gloo group (host transport) and checks that every rank holds the same metrics
        (a `LayoutMismatchError` on every rank if not). Moves the metrics to `device` if one was
        given, and every local state into one flat buffer per bucket (values kept): capture CUDA
        graphs of `update()` after `bind()`, with `torch.cuda.graph(..., capture_error_mode=
        "thread_local")`: while a collection is in flight the worker thread waits on CUDA events, which
        the default "global" mode forbids to every thread during a capture (docs/collection.md).
        Never call `schedule_collection()` inside a capture. Everything that may block happens here,
        so that `schedule_collection()` never does.

        A metric object is collected by one bound collector at a time, at one path of its tree:
        anything else raises a `ValueError` naming the metric and both places.
        """
        if self._state == "bound":
            raise RuntimeError("AsyncMetricCollector.bind: already bound; call unbind() before binding again")
        self._binding.claim(self._named, op="AsyncMetricCollector.bind")
        try:
            if self.device is not None:
                for _, metric in self._named:
                    metric.to(self.device)
            resolved = resolve_group(self._group, op="AsyncMetricCollector")
            self._storage = BoundStorage.build(self._named, group_world_size(resolved))
            self._binding.attach(self._named)
            self._transport = self._make_transport(self._storage, resolved)
        except BaseException:
            self._binding.release(self._named)
            raise
        self._windows = itertools.count()
        device = self._storage.device
        # The worker waits on CUDA events: on the metrics' device, not on a context it would create on GPU 0.
        initializer = functools.partial(_set_device, device) if device.type == "cuda" else None
        self._executor = ThreadExecutor(f"{_THREAD_PREFIX}-{next(_collector_ids)}", initializer=initializer)
        self._state = "bound"
        return self

    def transport_in_use(self) -> str:
        """ "host" or "device": what `transport` resolved to at `bind()`."""
        self._require_bound("transport_in_use")
        return "device" if isinstance(self._transport, DeviceTransport) else "host"

    def _make_transport(self, storage: BoundStorage, resolved: dist.ProcessGroup | None) -> Transport:
        backend = None if resolved is None else str(dist.get_backend(resolved))
        chosen = choose_transport(
            self.transport,
            device_type=storage.device.type,
            packed_bytes=storage.packed_bytes,
            backend=backend,
        )
        if chosen == "device":
            self._bound_group = resolved  # the training's own group: no second communicator
            return DeviceTransport(storage.window, storage.local, resolved, self.max_pending, self.timeout_s)
        self._bound_group = self._dedicated_group(resolved)
        return HostTransport(
            storage.window, storage.local, self._bound_group, self.max_pending, self.timeout_s
        )

    def _current_storage(self) -> BoundStorage:
        """The bound storage, rebuilt (with its transport) if one of this collector's metrics registered,
        replaced, dropped or moved an accumulator since (nothing else makes it stale)."""
        storage = self._storage
        assert storage is not None
        if self._binding.stale:
            storage.stage.close()  # what was staged lands in the states the rebuild copies
            rebuilt = BoundStorage.build(self._named, storage.window.world_size)
            if rebuilt.device != storage.device:
                raise RuntimeError(
                    f"AsyncMetricCollector.schedule_collection: metrics moved from {storage.device} to "
                    f"{rebuilt.device} since bind(); call unbind() and bind() again"
                )
            self._binding.attach(self._named)
            # Collections in flight keep the old transport's slots; the new one gets a ring of its own
            # (and checks the new layout across the ranks: this collection blocks, as bind() does).
            resolved = resolve_group(self._group, op="AsyncMetricCollector")
            self._transport = self._make_transport(rebuilt, resolved)
            storage = self._storage = rebuilt
        return storage

    def _dedicated_group(self, resolved: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The collector's own gloo group of `resolved`'s ranks (created once; see `dedicated_gloo_group`)."""
        if resolved is None:
            return None
        ranks = tuple(dist.get_process_group_ranks(resolved))
        if ranks not in self._dedicated_groups:
            self._dedicated_groups[ranks] = dedicated_gloo_group(ranks, self.timeout_s)
        return self._dedicated_groups[ranks]

    def unbind(self, timeout_s: float | None = None) -> None:
        """Finish in-flight collections (waiting up to `timeout_s`), then release the thread and groups.

        Results not yet collected are discarded.
        """
        if self._state != "bound":
            return
        assert self._storage is not None
        self._storage.stage.close()  # the metrics keep their storage, and update it at once from now on
        self._state = "unbound"
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        wait_ok = self._pending.finish(deadline)
        assert self._executor is not None
        self._executor.shutdown(wait=wait_ok)
        self._executor = None
        self._transport = None  # device slots still written by a side stream wait for it (record_stream)
        self._binding.release(self._named)
        if wait_ok:
            for pg in self._dedicated_groups.values():
                forget_group(pg)
                dist.destroy_process_group(pg)
        self._dedicated_groups.clear()
        self._bound_group = None

    def __enter__(self) -> AsyncMetricCollector:
        return self.bind()

    def __exit__(self, *exc: object) -> None:
        self.unbind()

    # -- the loop ---------------------------------------------------------------------

    def _require_bound(self, op: str) -> ThreadExecutor:
        check_same_process(self._pid, f"AsyncMetricCollector.{op}")
        if self._state == "new":
            raise RuntimeError(f"AsyncMetricCollector.{op}: not bound; call bind() first")
        if self._state == "unbound":
            raise RuntimeError(f"AsyncMetricCollector.{op}: already unbound; call bind() to use it again")
        assert self._executor is not None
        return self._executor

    def schedule_collection(
        self, *, step: int | None = None, then: Callable[[list[Any]], Any] | None = None
    ) -> None:
        """Snapshot the local state, reset it in place, and collect it in the background.

        Returns at once: no host sync, no allocation. With the device transport the window's
        collective is issued here, on this thread, asynchronously; otherwise none is. `step`
        (default: the window's index since `bind()`) rides in the payload: ranks whose windows
        end at different steps make `collect_results()` raise a `CollectionError` naming the steps.

        `then`, if given, runs on the worker thread with the window's results (one per metric, in
        tree order) as soon as they are ready, and `collect_results()` returns what it returned:
        work on the results that grows with the number of metrics stays off this thread.
        """
        executor = self._require_bound("schedule_collection")
        if len(self._pending) >= self.max_pending:
            raise RuntimeError(
                f"AsyncMetricCollector.schedule_collection: {len(self._pending)} collections are pending; "
                "call collect_results() first"
            )
        storage = self._current_storage()
        storage.stage.flush()
        assert self._transport is not None
        index = next(self._windows)
        finish = self._transport.schedule(index, index if step is None else step, storage.reset)
        if then is not None:
            finish = functools.partial(_then, finish, then)
        self._pending.add(PendingWindow(index, executor.submit(finish), then is not None))

    def apply_staged(self) -> None:
        """Apply the metrics' updates staged since the last call (`Telemetry.step()` calls it every
        step): a few tensor ops however many metrics were updated, no host sync. Reading a state
        (`compute()`, `local`) and `schedule_collection()` apply them too."""
        if self._storage is not None:
            self._storage.stage.flush()

    def ready(self) -> bool:
        """True when the oldest scheduled window can be collected without waiting."""
        self._require_bound("ready")
        return self._pending.ready()

    @property
    def pending(self) -> int:
        """Number of scheduled windows not yet collected."""
        return len(self._pending)

    def collect_results(self, timeout: float | None = None) -> Any:
        """Wait for the oldest scheduled window and return its results as Python scalars.

        Waits at most `timeout` seconds (default: the collector's `timeout_s`)
        and raises `CollectionError` (a RuntimeError) if the window failed or
        did not complete, e.g. because a rank never scheduled, died, or scheduled
        a window ending at another step. For a window scheduled with `then`, returns what
        `then` returned.
        """
        window, results = self._next_window("collect_results", timeout)
        return results if window.then else pytree.tree_unflatten(results, self._spec)

    def collect_results_by_metric(self, timeout: float | None = None) -> list[tuple[str, Any]]:
        """`collect_results`, as (metric path, result) pairs in tree order."""
        window, results = self._next_window("collect_results_by_metric", timeout)
        if window.then:
            raise RuntimeError(
                "AsyncMetricCollector.collect_results_by_metric: this window was scheduled with `then`, "
                "which received its results; call collect_results() for what `then` returned"
            )
        return [(name, result) for (name, _), result in zip(self._named, results, strict=True)]

    def _next_window(self, op: str, timeout: float | None) -> tuple[PendingWindow, Any]:
        self._require_bound(op)
        return self._pending.next(op, self.timeout_s if timeout is None else timeout, self.timeout_s)
