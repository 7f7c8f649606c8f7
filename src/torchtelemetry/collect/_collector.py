"""`AsyncMetricCollector`: snapshot on the training thread, sync and compute off it."""

from __future__ import annotations

import collections
import datetime
import itertools
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from torchtelemetry.collect._executors import ThreadExecutor, make_executor
from torchtelemetry.collect._results import to_python
from torchtelemetry.metric import Metric, MetricAccumulator
from torchtelemetry.metric._accumulator import layout_generation, window_state
from torchtelemetry.sync import (
    BucketKey,
    BucketLayout,
    GroupLike,
    LayoutMismatchError,
    metric_leaves,
    reduce_buffers,
    resolve_group,
)
from torchtelemetry.sync._sync import forget_group

__all__ = ["AsyncMetricCollector", "CollectionError"]

_THREAD_PREFIX = "torchtelemetry-collector"
_collector_ids = itertools.count()


class CollectionError(RuntimeError):
    """A scheduled collection failed or did not complete in time."""


@dataclass(slots=True)
class _Window:
    index: int
    future: Future


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a snapshot needs, built at bind(): every local state lives in one flat buffer per
    bucket, so a snapshot is one copy and a reset one copy per bucket, however many states."""

    layout: BucketLayout
    accumulators: tuple[MetricAccumulator, ...]
    storage: dict[BucketKey, torch.Tensor]
    """The flat buffers the accumulators keep their local state in (`MetricAccumulator.adopt`)."""
    initials: dict[BucketKey, torch.Tensor]
    """The initial states, laid out like `storage`."""
    device: torch.device
    generation: int
    """`layout_generation()` when built; a metric moved or re-registered since makes it stale."""

    def snapshot(self) -> dict[BucketKey, torch.Tensor]:
        """The packed buffers of the current local states."""
        return self.layout.pack_storage(self.storage)

    def reset(self) -> None:
        """Restore every local state to its initial value, in place."""
        torch._foreach_copy_(list(self.storage.values()), list(self.initials.values()))

    @classmethod
    def build(cls, named: list[tuple[str, Metric]]) -> _Plan:
        states = [
            (f"{name}.{attr}", acc) for name, metric in named for attr, acc in metric.accumulators.items()
        ]
        devices = {acc.device for _, acc in states}
        if len(devices) > 1:
            raise RuntimeError(
                f"AsyncMetricCollector: metrics live on several devices {sorted(map(str, devices))}; "
                "move them to one device with metric.to(device) first"
            )
        accumulators = [acc for _, acc in states]
        layout = BucketLayout([(name, acc.local, acc.reduce_op) for name, acc in states])
        storage = layout.storage([acc.local for acc in accumulators])
        for accumulator, view in zip(accumulators, layout.views(storage), strict=True):
            accumulator.adopt(view)
        return cls(
            layout=layout,
            accumulators=tuple(accumulators),
            storage=storage,
            initials=layout.storage([acc.initial for acc in accumulators]),
            device=devices.pop() if devices else torch.device("cpu"),
            generation=layout_generation(),
        )


class AsyncMetricCollector:
    """Collect a PyTree of Metrics without stalling the training loop.

    `schedule_collection()` snapshots the local state into a packed buffer and
    resets the metrics in place (updates made afterwards land in the next
    window), then a worker thread (plus a side stream on CUDA) reduces the
    buffer with one collective per bucket on a dedicated process group, runs
    each metric's `compute()` on that window's state and copies the results to
    host memory. `collect_results()` returns the oldest window's results as
    Python scalars, in the structure of the metrics' `compute()` outputs.

    Args:
        metrics: a Metric or a PyTree (dict, list, nested) of Metrics.
        group: ranks to reduce over (ProcessGroup, DeviceMesh, (mesh, dim) or None).
        timeout_s: bound on one collection; a rank that never schedules, or
            dies, makes `collect_results` raise within it instead of hanging.
        max_pending: scheduled windows allowed before `collect_results` must be called.
        device: where `bind()` moves the metrics (e.g. the rank's GPU); None keeps them where
            they are.
    """

    def __init__(
        self,
        metrics: Any,
        group: GroupLike = None,
        *,
        timeout_s: float = 300.0,
        max_pending: int = 64,
        device: torch.device | str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"AsyncMetricCollector: timeout_s must be positive, got {timeout_s}")
        if max_pending < 1:
            raise ValueError(f"AsyncMetricCollector: max_pending must be at least 1, got {max_pending}")
        self._metrics = metrics
        self._named = metric_leaves(metrics, op="AsyncMetricCollector")
        self._spec = pytree.tree_structure(metrics)
        self._group = group
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.device = None if device is None else torch.device(device)
        self._plan: _Plan | None = None
        self._executor: ThreadExecutor | None = None
        self._dedicated_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._pending: collections.deque[_Window] = collections.deque()
        self._windows = itertools.count()
        self._state = "new"

    # -- life cycle -------------------------------------------------------------------

    def bind(self) -> AsyncMetricCollector:
        """Prepare the executor (worker thread; side stream and events on CUDA) and the process group.

        Collective across the ranks of `group` when torch.distributed is initialized.
        Moves the metrics to `device` if one was given, and every local state into one
        flat buffer per bucket (values kept): capture CUDA graphs of `update()` after `bind()`.
        """
        if self._state == "bound":
            raise RuntimeError("AsyncMetricCollector.bind: already bound; call unbind() before binding again")
        if self.device is not None:
            for _, metric in self._named:
                metric.to(self.device)
        self._plan = _Plan.build(self._named)
        self._bound_group = self._dedicated_group(self._group)
        self._executor = make_executor(self._plan.device, f"{_THREAD_PREFIX}-{next(_collector_ids)}")
        self._state = "bound"
        return self

    def _current_plan(self) -> _Plan:
        """The bound plan, rebuilt if metrics were moved or changed their accumulators since."""
        plan = self._plan
        assert plan is not None
        if plan.generation != layout_generation():
            rebuilt = _Plan.build(self._named)
            if rebuilt.device != plan.device:
                raise RuntimeError(
                    f"AsyncMetricCollector.schedule_collection: metrics moved from {plan.device} to "
                    f"{rebuilt.device} since bind(); call unbind() and bind() again"
                )
            plan = self._plan = rebuilt
        return plan

    def _dedicated_group(self, group: GroupLike) -> dist.ProcessGroup | None:
        """A new process group of the same ranks, for this collector only, with its timeout.

        Its collectives never interleave with the training's or another
        collector's. Creating it is collective over the default group: ranks
        first learn every rank's group (one `all_gather_object`), then all of
        them create every group in the same order, as `new_group` requires.
        """
        resolved = resolve_group(group, op="AsyncMetricCollector")
        if resolved is None:
            return None
        ranks = tuple(dist.get_process_group_ranks(resolved))
        if ranks not in self._dedicated_groups:
            assert self._plan is not None
            # Metrics kept on the CPU reduce over gloo even when the training uses NCCL.
            backend = "gloo" if self._plan.device.type == "cpu" else dist.get_backend(resolved)
            every_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, ranks)
            for rank_set in sorted(set(every_rank)):
                created = dist.new_group(
                    ranks=list(rank_set),
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                    backend=backend,
                )
                if rank_set == ranks:
                    self._dedicated_groups[ranks] = created
        return self._dedicated_groups[ranks]

    def unbind(self, timeout_s: float | None = None) -> None:
        """Finish in-flight collections (waiting up to `timeout_s`), then release the thread and groups.

        Results not yet collected are discarded.
        """
        if self._state != "bound":
            return
        self._state = "unbound"
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        wait_ok = True
        for window in self._pending:
            try:
                window.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                wait_ok = False
                break
            except Exception:  # a failed window is discarded like an uncollected one
                continue
        self._pending.clear()
        assert self._executor is not None
        self._executor.shutdown(wait=wait_ok)
        self._executor = None
        if wait_ok:
            for pg in self._dedicated_groups.values():
                forget_group(pg)
                dist.destroy_process_group(pg)
        self._dedicated_groups.clear()

    def __enter__(self) -> AsyncMetricCollector:
        return self.bind()

    def __exit__(self, *exc: object) -> None:
        self.unbind()

    # -- the loop ---------------------------------------------------------------------

    def _require_bound(self, op: str) -> ThreadExecutor:
        if self._state == "new":
            raise RuntimeError(f"AsyncMetricCollector.{op}: not bound; call bind() first")
        if self._state == "unbound":
            raise RuntimeError(f"AsyncMetricCollector.{op}: already unbound; call bind() to use it again")
        assert self._executor is not None
        return self._executor

    def schedule_collection(self, group: GroupLike = None) -> None:
        """Snapshot the local state, reset it in place, and collect it in the background.

        Returns at once: no host sync, no collective on this thread. `group`
        overrides the bound group for this window.
        """
        executor = self._require_bound("schedule_collection")
        if len(self._pending) >= self.max_pending:
            raise RuntimeError(
                f"AsyncMetricCollector.schedule_collection: {len(self._pending)} collections are pending; "
                "call collect_results() first"
            )
        pg = self._bound_group if group is None else self._dedicated_group(group)
        plan = self._current_plan()
        snapshot = plan.snapshot()
        plan.reset()
        fence = executor.fence()
        future = executor.submit(self._collect, executor, plan, snapshot, fence, pg)
        self._pending.append(_Window(next(self._windows), future))

    def _collect(
        self, executor: ThreadExecutor, plan: _Plan, snapshot: dict, fence: Any, pg: dist.ProcessGroup | None
    ) -> tuple[list[Any], Any]:
        """Worker thread: reduce one window, compute every metric on it, copy results to the host."""
        with executor.running_after(fence, snapshot.values()):
            try:
                reduce_buffers(plan.layout, snapshot, pg)
            except LayoutMismatchError:
                raise
            except Exception as error:  # gloo / NCCL: a peer died, timed out or never joined
                raise CollectionError(
                    f"the all-reduce on the collector's process group (ranks "
                    f"{dist.get_process_group_ranks(pg) if pg is not None else []}) failed: a rank may have "
                    f"died or not called schedule_collection() within timeout_s={self.timeout_s:g}s "
                    f"({type(error).__name__}: {error})"
                ) from error
            states = plan.layout.unpack(snapshot)
            window = {id(acc): state for acc, state in zip(plan.accumulators, states, strict=True)}
            with window_state(window):
                results = [metric.compute() for _, metric in self._named]
            return executor.to_host(results)

    def ready(self) -> bool:
        """True when the oldest scheduled window can be collected without waiting."""
        executor = self._require_bound("ready")
        if not self._pending or not self._pending[0].future.done():
            return False
        window = self._pending[0].future
        return window.exception() is not None or executor.host_ready(window.result()[1])

    @property
    def pending(self) -> int:
        """Number of scheduled windows not yet collected."""
        return len(self._pending)

    def collect_results(self, timeout: float | None = None) -> Any:
        """Wait for the oldest scheduled window and return its results as Python scalars.

        Waits at most `timeout` seconds (default: the collector's `timeout_s`)
        and raises `CollectionError` (a RuntimeError) if the window failed or
        did not complete, e.g. because a rank never scheduled or died.
        """
        return pytree.tree_unflatten(self._next_window("collect_results", timeout), self._spec)

    def collect_results_by_metric(self, timeout: float | None = None) -> list[tuple[str, Any]]:
        """`collect_results`, as (metric path, result) pairs in tree order."""
        results = self._next_window("collect_results_by_metric", timeout)
        return [(name, result) for (name, _), result in zip(self._named, results, strict=True)]

    def _next_window(self, op: str, timeout: float | None) -> list[Any]:
        executor = self._require_bound(op)
        if not self._pending:
            raise RuntimeError(
                f"AsyncMetricCollector.{op}: nothing scheduled; call schedule_collection() first"
            )
        window = self._pending[0]
        limit = self.timeout_s if timeout is None else timeout
        try:
            results, handle = window.future.result(timeout=limit)
        except FutureTimeout:
            raise CollectionError(
                f"AsyncMetricCollector.{op}: window {window.index} did not complete in {limit:.1f}s; "
                "a rank may not have called schedule_collection(), may have died, or be far behind"
            ) from None
        except Exception as error:
            self._pending.popleft()
            reason = str(error) if isinstance(error, CollectionError) else f"{type(error).__name__}: {error}"
            raise CollectionError(f"AsyncMetricCollector.{op}: window {window.index} failed: {reason}") from (
                error.__cause__ if isinstance(error, CollectionError) else error
            )
        self._pending.popleft()
        executor.wait_host(handle)
        return [to_python(result) for result in results]
