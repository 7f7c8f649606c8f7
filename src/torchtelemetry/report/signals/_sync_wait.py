"""The sync wait: time each rank spends in the gradient all-reduce of synchronous data parallel.

Every rank leaves DDP's gradient all-reduce together, so the time a rank spends in it is the time
it waited for the last rank to arrive, plus the transfer: the rank that waits least is the one the
others wait for. `Telemetry.watch_gradient_sync(model)` registers a DDP communication hook (DDP's
own all-reduce, or the hook given) that times, per backward, from the launch of its last bucket
(every gradient computed) to the completion of every bucket: the time the step is blocked on the
collective. The gradient work DDP overlaps with the earlier buckets' all-reduce is not waiting and is
not counted (timed from the first bucket's launch, it was: 12-18 ms of a 17 ms backward on an H200,
in a world of one). Host time on CPU, where gloo completes the future on its own thread; on CUDA a
timing event recorded at the launch and one in the completion callback (on the stream that waits
for the collective), read at a later window once both completed (`query()`, never a wait on the
training thread). Exported per rank as `train/sync_wait`, seconds per step,
and taken out of the phase that holds the all-reduce by the straggler scores (`_stragglers`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from torchtelemetry.metric import Metric, MetricKind, PerRankMetric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming

__all__ = ["SYNC_WAIT", "SyncWait"]

SYNC_WAIT = "train/sync_wait"

CommHook = Callable[[Any, Any], torch.futures.Future]
"""A DDP communication hook: `(state, bucket) -> Future` of the reduced bucket."""


class SyncWait(Signal):
    """Seconds per step each rank spends in DDP's gradient all-reduce (once a model is watched)."""

    name = "sync_wait"

    def __init__(self, context: SignalContext) -> None:
        super().__init__(context)
        self.wait = PerRankMetric(
            context.world_size,
            context.rank,
            unit="seconds",
            description="Seconds per step in the gradient all-reduce (waiting for the other ranks), per rank",
        ).to(context.device)
        self._lock = threading.Lock()
        self._on_cuda = context.device.type == "cuda"
        self._started: Any = None  # the open span's start: perf_counter() or a CUDA event
        self._in_flight = 0
        self._last_launched = False
        self._seconds = 0.0
        self._spans: list[tuple[Any, Any]] = []  # CUDA events not yet read
        self._steps = 0
        self._watched = False

    def watch_gradient_sync(self, model: Any, phase: str, hook: CommHook | None, state: Any) -> bool:
        """Register the timed communication hook on DDP `model` (DDP takes one hook, once)."""
        register = getattr(model, "register_comm_hook", None)
        if register is None:
            raise TypeError(
                f"Telemetry.watch_gradient_sync: {type(model).__name__} has no register_comm_hook; pass "
                "the DistributedDataParallel module"
            )
        if hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            hook = allreduce_hook

        def timed(hook_state, bucket):  # type: ignore[no-untyped-def]
            self._launched(bucket.is_last())
            return hook(hook_state, bucket).then(self._completed)

        # Unannotated: DDP compares a hook's annotations with its own types, and this module's
        # are strings (postponed evaluation).
        register(state, timed)
        self._watched = True
        return True

    # -- the threads DDP runs the hook and its callbacks on ---------------------------------

    def _launched(self, last: bool) -> None:
        with self._lock:
            self._in_flight += 1
            if last:  # every gradient is computed: from here on the step waits for the collective
                self._started = self._mark()
                self._last_launched = True

    def _completed(self, future: torch.futures.Future) -> Any:
        with self._lock:
            self._in_flight -= 1
            if self._last_launched and not self._in_flight and self._started is not None:
                ended = self._mark()
                if self._on_cuda:
                    self._spans.append((self._started, ended))
                else:
                    self._seconds += ended - self._started
                self._started, self._last_launched = None, False
        return future.value()

    def _mark(self) -> Any:
        if not self._on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # -- the training thread ---------------------------------------------------------------

    def metrics(self) -> dict[str, Metric]:
        return {SYNC_WAIT: self.wait}

    def descriptors(self) -> list[MetricDescriptor]:
        return [MetricDescriptor(SYNC_WAIT, MetricKind.GAUGE, "seconds", self.wait.description, "rank")]

    def on_step(self, step: int, step_time: float | None) -> None:
        self._steps += 1

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        """Hand the spans that completed to the window; on CUDA, spans still running come with a
        later one (at a checkpoint and at close, `final`, they are waited for)."""
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
            pending, self._spans = self._spans, []
        for started, ended in pending:
            if final:
                ended.synchronize()
            if ended.query():
                seconds += started.elapsed_time(ended) / 1000
            else:
                with self._lock:
                    self._spans.append((started, ended))
        if self._watched:
            self.wait.update_total(seconds, float(self._steps))
        self._steps = 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        if not self._watched:
            window.pop(SYNC_WAIT, None)
