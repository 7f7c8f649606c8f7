"""`DeviceTransport`: the training thread issues the window's collective on the training's own group.

For large CUDA states (a confusion matrix over thousands of classes). The slots live on the
device; inside `schedule_collection()` the collective is issued asynchronously, in program order
on every rank, so it cannot interleave with the training's own collectives (DDP, FSDP)
differently on different ranks. On CUDA the exchange, the built-in metrics' batched compute and
ONE packed device-to-host copy (plus one per dtype of custom metrics' states) are enqueued on a
high-priority side stream that waits for the snapshot; the worker waits (sleeping) for the final
event, then runs custom metrics' `compute()` on the host, where a `.item()` or a result of another
shape costs the training thread nothing. What it hands the worker (`_finish_on_host`, `_read`)
only waits on a Work handle or an event and never receives a process group to issue on.

Set up at `bind()` (`_prepare`), never in a window: the side stream, the events, the pinned
buffers for the packed results (sized by one dry run of the built-in rules, whose shapes are
fixed) and for custom metrics' states, and `record_stream` of
every slot on the side stream, so that slots freed by an `unbind()` that timed out are not
reused while the side stream (and the NCCL work it waits for) may still write them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torchtelemetry.collect._transports import (
    Finish,
    Transport,
    cuda_events,
    reduce_failure,
)
from torchtelemetry.sync import BucketKey, LayoutMismatchError, Slot, WindowExchange

__all__ = ["DeviceTransport"]

_HIGH_PRIORITY = -1
"""A high-priority stream (every torch version maps -1 to one): the window's few small kernels run
between the training's long ones instead of queueing behind them."""


def _raise(error: Exception) -> list[Any]:
    raise error


def _wait(works: list[Any], exchange: WindowExchange, timeout_s: float) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as error:
        raise reduce_failure(error, exchange.group, timeout_s) from error


class DeviceTransport(Transport):
    """Device slots reduced by the training thread on the training's own group, asynchronously."""

    issued_by_worker = False

    def compute_device(self) -> torch.device:
        return self.plan.device

    def _new_slot(self) -> Slot:
        return self.exchange.new_slot(self.plan.device, private_rows=True)

    def _prepare(self) -> None:
        device = self.plan.device
        self._stream = torch.cuda.Stream(device, priority=_HIGH_PRIORITY) if device.type == "cuda" else None
        self._results: list[torch.Tensor] = []
        """Pinned host buffers for each ring slot's packed results (built-in metrics and steps)."""
        self._custom_states: list[dict[BucketKey, torch.Tensor]] = []
        """Pinned host buffers for each ring slot's custom metrics' states, computed by the worker."""
        if self._stream is None:
            return
        ring = len(self._slots)
        self._snapshots = cuda_events(ring, device, blocking=False)  # waited on by the side stream only
        self._done = cuda_events(ring, device, blocking=True)  # waited on by the worker
        for slot in self._slots:
            slot.data.record_stream(self._stream)
            if slot.rows is not None:
                slot.rows.record_stream(self._stream)
        first = self._slots[0]
        if first.rows is not None:
            first.rows.zero_()
        # A dry run: the results' size (built-in rules give the same shapes every window). On the side
        # stream, as every window: what it allocates to keep (a gathered reduction's buffers) is the
        # side stream's, like the slots it reads.
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            flat, _ = self.plan.compute(self.exchange.reduced(first), custom=False)
        self._results = [torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True) for _ in range(ring)]
        self._custom_states = [self.plan.custom_states_like(pin_memory=True) for _ in range(ring)]
        self.plan.prepare(torch.device("cpu"))  # custom metrics compute on the host, in the worker
        self._stream.synchronize()

    def schedule(self, window: int, step: int, reset: Any) -> Finish:
        """Training thread: snapshot, then issue the collective here, in program order on every rank."""
        plan, exchange = self.plan, self.exchange
        slot = self._snapshot(window, reset)
        plan.write_step(slot.buffers, exchange.rank, step)
        exchange.negate_min_(slot)
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
        plan, exchange, stream = self.plan, self.exchange, self._stream
        assert stream is not None
        index = window % len(self._slots)
        snapshot = self._snapshots[index]
        snapshot.record(torch.cuda.current_stream(plan.device))
        with torch.cuda.stream(stream):
            stream.wait_event(snapshot)
            works = exchange.reduce(slot, async_op=True)
            for work in works:
                work.wait()  # the side stream waits for the collective; the host does not
            reduced = exchange.reduced(slot)
            flat, placement = plan.compute(reduced, custom=False)
            host = self._results[index]
            host.copy_(flat, non_blocking=True)
            custom = self._custom_states[index]
            for key, states in plan.custom_states(reduced).items():
                custom[key].copy_(states, non_blocking=True)
            done = self._done[index]
            done.record(stream)
        return functools.partial(self._read, host, placement, custom, done)

    def _finish_on_host(self, slot: Slot, works: list[Any]) -> list[Any]:
        """Worker thread: wait for the Work issued by the training thread, then compute (custom
        metrics from their states apart, as on CUDA)."""
        _wait(works, self.exchange, self.timeout_s)
        reduced = self.exchange.reduced(slot)
        custom = self.plan.compute_custom(self.plan.custom_states(reduced))
        return self.plan.results(*self.plan.compute(reduced, custom=False), custom)

    def _read(
        self,
        host: torch.Tensor,
        placement: Any,
        custom: dict[BucketKey, torch.Tensor],
        done: torch.cuda.Event,
    ) -> list[Any]:
        """Worker thread: wait for the packed results (sleeping, GIL released), compute the custom
        metrics on the host (their `compute()` may read values or change shape: not on the training
        thread), and read everything."""
        done.synchronize()
        return self.plan.results(host, placement, self.plan.compute_custom(custom) if custom else None)
