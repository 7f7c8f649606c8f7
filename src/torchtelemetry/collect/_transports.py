"""Transports: where a window's collective runs, and who may issue it.

Both transports share everything but the device work: the snapshot is ONE copy per bucket
of the metrics' flat local storage into a slot of a ring allocated at `bind()` (then one
reset), the slot is reduced by `WindowExchange` (one collective while small) and computed
by `WindowPlan` (batched per class, one flat result tensor, Python values at once).

- `HostTransport` (CPU metrics; CUDA metrics whose packed state is small): the slots are host
  memory (pinned on CUDA, so the copy is non-blocking and ordered by an event). The worker thread
  waits for the event, then reduces on a gloo group of the same ranks and computes on the host.
- `DeviceTransport` (large CUDA states): the slots live on the device and the training thread
  itself issues the collective, inside `schedule_collection()`, on the training's own group,
  asynchronously; on CUDA the exchange, the compute and ONE packed device-to-host copy are
  enqueued on a side stream, and the worker only waits for the final event.

NCCL forbids issuing operations on independent communicators in parallel from several threads,
so a collective on an accelerator group is only ever issued from `DeviceTransport.schedule()`,
which runs on the thread that called `schedule_collection()`; what it hands the worker
(`_finish_on_host`, `_read`) only waits on a Work handle or an event. The one transport whose
worker issues collectives (`issued_by_worker = True`: `HostTransport`) is refused any group but
a gloo one in `Transport.__init__`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.collect._window import WindowPlan
from torchtelemetry.metric import Metric, MetricAccumulator, layout_generation
from torchtelemetry.sync import BucketKey, LayoutMismatchError, Slot, WindowExchange

__all__ = [
    "HOST_TRANSPORT_LIMIT_BYTES",
    "CollectionError",
    "DeviceTransport",
    "Finish",
    "HostTransport",
    "Plan",
    "Transport",
]

HOST_TRANSPORT_LIMIT_BYTES = 1 << 20
"""`transport="auto"` moves a window of CUDA metrics through the host up to this many packed bytes."""

Finish = Callable[[], list[Any]]
"""The worker's part of one window: returns each metric's results as Python values."""


class CollectionError(RuntimeError):
    """A scheduled collection failed or did not complete in time."""


def reduce_failure(error: Exception, group: dist.ProcessGroup | None, timeout_s: float) -> CollectionError:
    """The error for a collective that failed: gloo / NCCL lost a peer, timed out, or a rank never joined."""
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    return CollectionError(
        f"the all-reduce on the collector's process group (ranks {ranks}) failed: a rank may have died or "
        f"not called schedule_collection() within timeout_s={timeout_s:g}s ({type(error).__name__}: {error})"
    )


def _raise(error: Exception) -> list[Any]:
    raise error


def _wait(works: list[Any], exchange: WindowExchange, timeout_s: float) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as error:
        raise reduce_failure(error, exchange.group, timeout_s) from error


@dataclass(frozen=True, slots=True)
class Plan:
    """What a snapshot needs, built at bind(): every local state lives in one flat buffer per
    bucket, so a snapshot is one copy and a reset one copy per bucket, however many states."""

    window: WindowPlan
    storage: dict[BucketKey, torch.Tensor]
    """The flat buffers the accumulators keep their local state in (`MetricAccumulator.adopt`)."""
    initials: dict[BucketKey, torch.Tensor]
    """The initial states, laid out like `storage`."""
    generation: int
    """`layout_generation()` when built; a metric moved or re-registered since makes it stale."""

    @property
    def device(self) -> torch.device:
        return self.window.device

    def reset(self) -> None:
        """Restore every local state to its initial value, in place."""
        torch._foreach_copy_(list(self.storage.values()), list(self.initials.values()))

    @classmethod
    def build(cls, named: list[tuple[str, Metric]], world_size: int) -> Plan:
        try:
            window = WindowPlan(named, world_size)
        except RuntimeError as error:
            raise RuntimeError(f"AsyncMetricCollector: {error}") from None
        layout = window.layout
        storage = layout.storage(window.local_tensors())
        accumulator: MetricAccumulator
        for accumulator, view in zip(window.accumulators, layout.views(storage), strict=False):
            accumulator.adopt(view)
        return cls(
            window=window,
            storage=storage,
            initials=layout.storage(window.initial_tensors()),
            generation=layout_generation(),
        )


class Transport:
    """The ring of slots and the snapshot into them, shared by both transports."""

    issued_by_worker: bool
    """Whether the worker thread issues the collectives (then only on a gloo group)."""

    def __init__(
        self,
        plan: WindowPlan,
        storage: dict[Any, torch.Tensor],
        group: dist.ProcessGroup | None,
        ring: int,
        timeout_s: float,
    ) -> None:
        if self.issued_by_worker and group is not None and dist.get_backend(group) != "gloo":
            # NCCL's thread-safety rule: a worker thread never drives an accelerator communicator.
            raise ValueError(f"{type(self).__name__}: needs a gloo group, got {dist.get_backend(group)}")
        self.plan = plan
        self.exchange = WindowExchange(plan.layout, group)
        self.timeout_s = timeout_s
        self._sources = [storage[key] for key in plan.layout.buckets]
        self._slots = [self._new_slot() for _ in range(ring)]
        self._prepare()

    def _new_slot(self) -> Slot:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Per-transport set-up once the ring exists."""

    def _snapshot(self, window: int, reset: Callable[[], None]) -> Slot:
        """Copy the local storage into the window's slot (one copy per bucket), then reset it."""
        slot = self._slots[window % len(self._slots)]
        for target, source in zip(slot.buffers.values(), self._sources, strict=True):
            target.copy_(source, non_blocking=True)
        reset()
        return slot

    def schedule(self, window: int, step: int, reset: Callable[[], None]) -> Finish:
        """Training thread: snapshot window `window` (ending at `step`); the worker's part is returned."""
        raise NotImplementedError


class HostTransport(Transport):
    """Host slots (pinned on CUDA) reduced by the worker on a gloo group, computed on the host."""

    issued_by_worker = True

    def _new_slot(self) -> Slot:
        return self.exchange.new_slot(torch.device("cpu"), pin_memory=self.plan.device.type == "cuda")

    def schedule(self, window: int, step: int, reset: Callable[[], None]) -> Finish:
        slot = self._snapshot(window, reset)
        copied = None
        if self.plan.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.plan.device))
        return functools.partial(self._finish, slot, step, copied)

    def _finish(self, slot: Slot, step: int, copied: torch.cuda.Event | None) -> list[Any]:
        """Worker thread: wait for the copy (releasing the GIL), reduce over gloo, compute on the host."""
        if copied is not None:
            copied.synchronize()
        plan, exchange = self.plan, self.exchange
        plan.write_step(slot.buffers, exchange.rank, step)
        plan.layout.negate_min_(slot.buffers)
        try:
            exchange.reduce(slot)
        except LayoutMismatchError:
            raise
        except Exception as error:
            raise reduce_failure(error, exchange.group, self.timeout_s) from error
        return plan.results(*plan.compute(exchange.reduced(slot)))


class DeviceTransport(Transport):
    """Device slots reduced by the training thread on the training's own group, asynchronously."""

    issued_by_worker = False

    def _prepare(self) -> None:
        plan = self.plan
        self._stream = torch.cuda.Stream(plan.device) if plan.device.type == "cuda" else None
        self._results: list[torch.Tensor] = []
        """Pinned host buffers for each ring slot's packed results, allocated at the first window."""

    def _new_slot(self) -> Slot:
        return self.exchange.new_slot(self.plan.device, private_rows=True)

    def schedule(self, window: int, step: int, reset: Callable[[], None]) -> Finish:
        """Training thread: snapshot, then issue the collective here, in program order on every rank."""
        plan, exchange = self.plan, self.exchange
        slot = self._snapshot(window, reset)
        plan.write_step(slot.buffers, exchange.rank, step)
        plan.layout.negate_min_(slot.buffers)
        try:
            if self._stream is None:  # metrics on the CPU: the worker waits for the Work, then computes
                return functools.partial(self._finish_on_host, slot, exchange.reduce(slot, async_op=True))
            return self._enqueue_on_side_stream(window, slot)
        except Exception as error:  # reported by collect_results(), like a failure on the worker
            failure = error
            if not isinstance(error, LayoutMismatchError):
                failure = reduce_failure(error, exchange.group, self.timeout_s)
                failure.__cause__ = error
            return functools.partial(_raise, failure)

    def _enqueue_on_side_stream(self, window: int, slot: Slot) -> Finish:
        """Training thread, CUDA: the collective, the compute and one packed copy to pinned memory, all
        enqueued on the side stream after the snapshot; nothing waits on the host."""
        plan, exchange = self.plan, self.exchange
        snapshot = torch.cuda.Event()
        snapshot.record(torch.cuda.current_stream(plan.device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(snapshot)
            works = exchange.reduce(slot, async_op=True)
            for work in works:
                work.wait()  # the side stream waits for the collective; the host does not
            flat, layout = plan.compute(exchange.reduced(slot))
            if not self._results or self._results[0].shape != flat.shape:
                self._results = [
                    torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True) for _ in self._slots
                ]
            host = self._results[window % len(self._slots)]
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return functools.partial(self._read, host, layout, done)

    def _finish_on_host(self, slot: Slot, works: list[Any]) -> list[Any]:
        """Worker thread: wait for the Work issued by the training thread, then compute."""
        _wait(works, self.exchange, self.timeout_s)
        return self.plan.results(*self.plan.compute(self.exchange.reduced(slot)))

    def _read(self, host: torch.Tensor, layout: Any, done: torch.cuda.Event) -> list[Any]:
        """Worker thread: wait for the packed results (releasing the GIL) and read them."""
        done.synchronize()
        return self.plan.results(host, layout)
