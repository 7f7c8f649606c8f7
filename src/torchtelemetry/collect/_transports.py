"""Transports: where a window's collective runs, and who may issue it.

Both transports share everything but the device work: the snapshot is ONE copy per bucket
of the metrics' flat local storage into a slot of a ring allocated at `bind()` (then one
reset), the slot is reduced by `WindowExchange` (one collective while small) and computed
by `WindowPlan` (batched per class, one flat result tensor, Python values at once).

- `HostTransport` (CPU metrics; CUDA metrics whose packed state is small): the slots are host
  memory (pinned on CUDA, so the copy is non-blocking and ordered by an event). The worker thread
  waits for the event, then reduces on a gloo group of the same ranks and computes on the host.
- `DeviceTransport` (`_device.py`; large CUDA states): the slots live on the device and the
  training thread itself issues the collective, inside `schedule_collection()`, on the training's
  own group, asynchronously.

Everything that may block (the ranks' layout check, pinned allocations, events, constants and
custom metrics' tensor attributes copied to where the window computes) happens at `bind()`, in
`Transport.__init__`; `schedule()` only enqueues.

NCCL forbids issuing operations on independent communicators in parallel from several threads,
so a collective on an accelerator group is only ever issued from `DeviceTransport.schedule()`,
which runs on the thread that called `schedule_collection()`. The one transport whose worker
issues collectives (`issued_by_worker = True`: `HostTransport`) is refused any group but a gloo
one in `Transport.__init__`.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from torchtelemetry.collect._window import WindowPlan
from torchtelemetry.metric import Metric, MetricAccumulator, UpdateStage
from torchtelemetry.sync import BucketKey, LayoutMismatchError, Slot, WindowExchange, slot_holding

__all__ = [
    "DEFAULT_MAX_PENDING",
    "DEFAULT_TIMEOUT_S",
    "HOST_TRANSPORT_LIMIT_BYTES",
    "NCCL_BLOCKING_WAIT_VARIABLES",
    "BoundStorage",
    "CollectionError",
    "Finish",
    "HostTransport",
    "Transport",
    "TransportName",
    "check_collection_limits",
    "choose_transport",
    "dedicated_gloo_group",
    "nccl_blocking_wait",
    "reduce_failure",
]

logger = logging.getLogger(__name__)

HOST_TRANSPORT_LIMIT_BYTES = 1 << 20
"""`transport="auto"` moves a collection of CUDA metrics through the host up to this many packed bytes."""

DEFAULT_MAX_PENDING = 2
"""Collections in flight before `collect_results()` must be called, and so the size of the ring of
slots (on CUDA with the host transport, pinned host memory of this many times the packed state).
The one default: `AsyncMetricCollector` and `TelemetryConfig` both take it from here."""

DEFAULT_TIMEOUT_S = 300.0
"""Bound on one collection, the one default of `AsyncMetricCollector` and `TelemetryConfig`."""

TransportName = Literal["host", "device", "auto"]

Finish = Callable[[], list[Any]]
"""The worker's part of one window: returns each metric's results as Python values."""


class CollectionError(RuntimeError):
    """A scheduled collection failed or did not complete in time."""


def check_collection_limits(owner: str, *, timeout_s: float, max_pending: int) -> None:
    """The one rule for the collection bounds. `TelemetryConfig` and `AsyncMetricCollector` each call it
    where they are built (the first place a bad value can be named to its user); nothing else checks
    them (`owner` prefixes the key in the error, e.g. "TelemetryConfig.")."""
    if not timeout_s > 0:
        raise ValueError(f"{owner}timeout_s must be positive, got {timeout_s}")
    if max_pending < 1:
        raise ValueError(f"{owner}max_pending must be at least 1, got {max_pending}")


def reduce_failure(error: Exception, group: dist.ProcessGroup | None, timeout_s: float) -> CollectionError:
    """The error for a collective that failed: gloo / NCCL lost a peer, timed out, or a rank never joined."""
    ranks = dist.get_process_group_ranks(group) if group is not None else []
    return CollectionError(
        f"the all-reduce on the collector's process group (ranks {ranks}) failed: a rank may have died or "
        f"not called schedule_collection() within timeout_s={timeout_s:g}s ({type(error).__name__}: {error})"
    )


@dataclass(frozen=True, slots=True)
class BoundStorage:
    """Where a bound collector's metrics keep their local state, built at bind(): every local state
    lives in one flat buffer per bucket, the buckets in one block of bytes laid out as a window's slot,
    so a snapshot is one copy and a reset one copy however many states, and the updates of a step are
    applied in a few ops however many metrics they update (`stage`). `window` is the `WindowPlan` that
    lays the buffers out and computes them."""

    window: WindowPlan
    local: Slot
    """The local states: `local.buffers` are the flat buffers the accumulators keep their state in
    (`MetricAccumulator.adopt`), views of `local.data`."""
    initial: Slot
    """The initial states, laid out alike."""
    stage: UpdateStage
    """Where the metrics' updates are staged until flushed (every step, and before a snapshot)."""

    @property
    def device(self) -> torch.device:
        return self.window.device

    @property
    def buffers(self) -> dict[BucketKey, torch.Tensor]:
        return self.local.buffers

    @property
    def packed_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers.values())

    def reset(self) -> None:
        """Restore every local state to its initial value, in place (one copy)."""
        self.local.data.copy_(self.initial.data)

    @classmethod
    def build(cls, named: list[tuple[str, Metric]], world_size: int) -> BoundStorage:
        try:
            window = WindowPlan(named, world_size)
        except RuntimeError as error:
            raise RuntimeError(f"AsyncMetricCollector: {error}") from None
        layout = window.layout
        local = slot_holding(layout, window.local_tensors())
        places = [layout.offset(index) for index in range(len(window.accumulators))]
        names = {place: layout.names[index] for index, place in enumerate(places)}
        stage = UpdateStage(local.buffers, names, local.host)
        accumulator: MetricAccumulator
        views = layout.views(local.buffers)
        for accumulator, view, (key, offset) in zip(window.accumulators, views, places, strict=False):
            part = stage.part(key)
            accumulator.adopt(view, None if part is None else (part, offset))
        initial = slot_holding(layout, window.initial_tensors())
        return cls(window=window, local=local, initial=initial, stage=stage)


NCCL_BLOCKING_WAIT_VARIABLES = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""What makes ProcessGroupNCCL's `Work.wait()` block the host until the collective completes
(read when the group is created; the first one set wins, as in ProcessGroupNCCL.hpp)."""


def nccl_blocking_wait() -> bool:
    """Whether NCCL groups created now wait on the host (`TORCH_NCCL_BLOCKING_WAIT=1`, parsed as
    c10d's `getCvarBool` parses it)."""
    for name in NCCL_BLOCKING_WAIT_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            return value.strip().lower() in ("y", "yes", "1", "t", "true")
    return False


def choose_transport(
    requested: TransportName, *, device_type: str, packed_bytes: int, backend: str | None
) -> str:
    """ "host" or "device" for `requested` ("auto" decides by size, device and group), or a
    `ValueError` for a device transport the group cannot run without blocking or at all."""
    on_cuda = device_type == "cuda"
    # Under NCCL's blocking wait, the device transport's Work.wait() on the training thread would wait
    # on the host for every window's collective (ProcessGroupNCCL::WorkNCCL::wait).
    blocking_wait = on_cuda and backend is not None and "nccl" in backend and nccl_blocking_wait()
    if requested == "auto":
        # gloo alone runs a CUDA tensor's collective on the host: its wait() would block the training thread.
        large = packed_bytes > HOST_TRANSPORT_LIMIT_BYTES
        if on_cuda and large and blocking_wait:
            logger.warning(
                "AsyncMetricCollector: %s is set, so NCCL's Work.wait() blocks the host until the collective "
                "completes; the %d-byte window goes through the host transport (gloo, from the worker) "
                "instead of the device transport, which would wait on the training thread every window",
                _set_blocking_wait_variable(),
                packed_bytes,
            )
        return "device" if on_cuda and large and backend != "gloo" and not blocking_wait else "host"
    if requested == "device":
        if not on_cuda and backend is not None and "gloo" not in backend:
            raise ValueError(
                f"AsyncMetricCollector: transport='device' reduces CPU metrics on the training's {backend} "
                "group, which cannot take CPU tensors; use transport='host' (or 'auto') for CPU metrics"
            )
        if on_cuda and backend == "gloo":
            raise ValueError(
                "AsyncMetricCollector: transport='device' on a gloo group would block the training thread "
                "every window (gloo waits for a CUDA tensor's collective on the host); use "
                "transport='host' (or 'auto'), or an NCCL group"
            )
        if blocking_wait:
            raise ValueError(
                f"AsyncMetricCollector: transport='device' under {_set_blocking_wait_variable()} would block "
                "the training thread every window (NCCL's Work.wait() then waits on the host for the "
                "collective); use transport='host' (or 'auto'), or unset it"
            )
    return requested


def _set_blocking_wait_variable() -> str:
    name = next(name for name in NCCL_BLOCKING_WAIT_VARIABLES if name in os.environ)
    return f"{name}={os.environ[name]}"


def dedicated_gloo_group(ranks: tuple[int, ...], timeout_s: float) -> dist.ProcessGroup:
    """A new gloo process group of `ranks`, for one collector only, with its timeout.

    Its collectives never interleave with the training's or another collector's, and gloo may
    be driven from the worker thread. Creating it is collective over the default group: ranks
    first learn every rank's group (one `all_gather_object`), then all of them create every
    group in the same order, as `new_group` requires.
    """
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, ranks)
    mine = None
    for rank_set in sorted(set(every_rank)):
        created = dist.new_group(
            ranks=list(rank_set), timeout=datetime.timedelta(seconds=timeout_s), backend="gloo"
        )
        if rank_set == ranks:
            mine = created
    assert mine is not None
    return mine


class Transport:
    """The ring of slots and the snapshot into them, shared by both transports."""

    issued_by_worker: bool
    """Whether the worker thread issues the collectives (then only on a gloo group)."""

    def __init__(
        self,
        plan: WindowPlan,
        storage: Slot,
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
        self._source = storage.data
        self._slots = [self._new_slot() for _ in range(ring)]
        compute_device = self.compute_device()
        self.exchange.verify(compute_device)  # raises LayoutMismatchError on every rank, here, at bind
        plan.prepare(compute_device)
        self._prepare()

    def compute_device(self) -> torch.device:
        """Where the window is reduced and computed."""
        raise NotImplementedError

    def _new_slot(self) -> Slot:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Per-transport set-up once the ring exists (at bind: may allocate and block)."""

    def _snapshot(self, window: int, reset: Callable[[], None]) -> Slot:
        """Copy the local storage into the window's slot (one copy of its bytes), then reset it."""
        slot = self._slots[window % len(self._slots)]
        slot.data.copy_(self._source, non_blocking=True)
        reset()
        return slot

    def schedule(self, window: int, step: int, reset: Callable[[], None]) -> Finish:
        """Training thread: snapshot window `window` (ending at `step`); the worker's part is returned."""
        raise NotImplementedError


def cuda_events(count: int, device: torch.device, *, blocking: bool) -> list[torch.cuda.Event]:
    """`count` events, created now on `device` (a first `record` creates them); `blocking` ones make a
    thread that waits on them sleep instead of spinning a core (`cudaEventBlockingSync`)."""
    events = [torch.cuda.Event(blocking=blocking) for _ in range(count)]
    for event in events:
        event.record(torch.cuda.current_stream(device))
    return events


class HostTransport(Transport):
    """Host slots (pinned on CUDA) reduced by the worker on a gloo group, computed on the host."""

    issued_by_worker = True

    def compute_device(self) -> torch.device:
        return torch.device("cpu")

    def _new_slot(self) -> Slot:
        return self.exchange.new_slot(torch.device("cpu"), pin_memory=self.plan.device.type == "cuda")

    def _prepare(self) -> None:
        device = self.plan.device
        self._copied = cuda_events(len(self._slots), device, blocking=True) if device.type == "cuda" else []

    def schedule(self, window: int, step: int, reset: Callable[[], None]) -> Finish:
        slot = self._snapshot(window, reset)
        copied = None
        if self._copied:
            copied = self._copied[window % len(self._copied)]
            copied.record(torch.cuda.current_stream(self.plan.device))
        return functools.partial(self._finish, slot, step, copied)

    def _finish(self, slot: Slot, step: int, copied: torch.cuda.Event | None) -> list[Any]:
        """Worker thread: wait for the copy (sleeping, GIL released), reduce over gloo, compute on host."""
        if copied is not None:
            copied.synchronize()
        plan, exchange = self.plan, self.exchange
        plan.write_step(slot.buffers, exchange.rank, step)
        exchange.negate_min_(slot)
        try:
            exchange.reduce(slot)
        except LayoutMismatchError:
            raise
        except Exception as error:
            raise reduce_failure(error, exchange.group, self.timeout_s) from error
        return plan.results(*plan.compute(exchange.reduced(slot)))
