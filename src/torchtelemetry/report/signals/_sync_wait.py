"""The sync wait: time each rank's backward stays blocked on the gradient collective after its own
gradients are computed.

Every rank leaves the gradient all-reduce of synchronous data parallel together, so the time a rank
spends blocked there after its last gradient is ready is the time it waited for the last rank to
arrive, plus the transfer's tail: the rank that waits least is the one the others wait for.
`Telemetry.watch_gradient_sync(model)` measures it without touching the communication: it registers
no communication hook and changes no gradient, so DDP's own process group, a user's comm hook
(compression, PowerSGD) and FSDP2 all stay as they are. Per backward pass through `model`:

- a forward hook on `model` marks the outputs' gradients (a tensor hook that returns nothing): when
  the first of them arrives, a backward through the model has begun, and a callback is queued on
  the autograd engine (`queue_callback`, once per graph task);
- that callback runs when every node of the backward has run, every gradient computed, and marks
  the start: callbacks run in the order queued, and DDP queues its `finalize_backward` only when
  its last bucket is ready (FSDP2 its own at its first pre-backward hook, after this one: the
  forward hook is registered first). It queues a second callback, which runs after every callback
  queued before it: after DDP's `finalize_backward` waited for its buckets' all-reduce. It marks
  the end.

End minus start, summed over the backward passes of a step (gradient accumulation under `no_sync()`
adds only the engine's bookkeeping, microseconds: no collective runs), is the wait. Host time on CPU
(gloo blocks the callback until the collective is done); on CUDA a timing event recorded on the
backward's current stream at each mark (DDP's finalize makes that stream wait for NCCL), read at a
later window once both completed (`query()`, never a wait on the training thread). Exported per rank
as `train/sync_wait`, seconds per step, and taken out of the phase that holds the collective by the
straggler scores (`_stragglers`). Under FSDP2 the all-gathers (and on CPU the reduce-scatters) wait
inside the forward and the backward, before the last gradient: only the tail after it is measured,
and `watch_gradient_sync` says so once. `close()` removes the forward hooks.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from torchtelemetry.metric import Metric, MetricKind, PerRankMetric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming
from torchtelemetry.report.signals._timeline import NO_SECTIONS, SYNC_WAIT_SECTION, SectionLog

__all__ = ["SYNC_WAIT", "SyncWait"]

SYNC_WAIT = "train/sync_wait"
MAX_WAITS_KEPT = 1024
"""Backward passes a window keeps the times of for its trace (gradient accumulation runs several)."""

logger = logging.getLogger(__name__)


class SyncWait(Signal):
    """Seconds per step each rank's backward waits for the gradient collective (once a model is watched)."""

    name = "sync_wait"

    def __init__(self, context: SignalContext, log: SectionLog = NO_SECTIONS) -> None:
        """`log`: the window's timeline for its trace, where each wait goes as the section "sync_wait"."""
        super().__init__(context)
        self.wait = PerRankMetric(
            context.world_size,
            context.rank,
            unit="seconds",
            description="Seconds per step the backward waited for the gradient collective, per rank",
        ).to(context.device)
        self._lock = threading.Lock()
        self._device = context.device
        self._task = -1  # the autograd graph task whose end is being timed
        self._seconds = 0.0
        self._spans: list[tuple[Any, Any]] = []  # CUDA events not yet read
        self._log = log
        self._kind = log.kind(SYNC_WAIT_SECTION) if log.keeps else 0
        self._waits: list[tuple[float, float]] = []  # host times for the log, handed over at flush
        self._steps = 0
        self._watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._watching = False
        self._closed = False

    def watch_gradient_sync(self, model: Any) -> None:
        """Time the backward passes through `model` (a forward hook; `model` itself is not changed)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"Telemetry.watch_gradient_sync: model must be a torch.nn.Module (the DDP or FSDP2 "
                f"module, or the module they wrap), got {type(model).__name__}"
            )
        self._watching = True
        if model not in self._watched:
            self._watched.add(model)
            # First: FSDP2's own post-forward hook then marks the outputs after this one, so its
            # final callback is queued after the one that marks the gradients computed.
            self._handles.append(model.register_forward_hook(self._forward, prepend=True))
            if _sharded_by_fsdp2(model):
                logger.warning(
                    "Telemetry.watch_gradient_sync: %s is sharded by fully_shard (FSDP2), whose "
                    "all-gathers (and on CPU the reduce-scatters) wait inside the forward and the "
                    "backward; train/sync_wait measures the wait after the last gradient only, so a "
                    "rank that waits there can still score slow in those phases (docs/signals.md)",
                    type(model).__name__,
                )

    # -- the threads the autograd engine runs hooks and callbacks on ------------------------

    def _forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._backward_began)

    def _backward_began(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with self._lock:
            if task == self._task or self._closed:
                return
            self._task = task
        Variable._execution_engine.queue_callback(self._gradients_computed)

    def _gradients_computed(self) -> None:
        started = self._mark()
        Variable._execution_engine.queue_callback(lambda: self._collective_done(started))

    def _collective_done(self, started: Any) -> None:
        ended = self._mark()
        with self._lock:
            if self._device.type == "cuda":
                self._spans.append((started, ended))
            else:
                self._seconds += ended - started
                if self._log.keeps and len(self._waits) < MAX_WAITS_KEPT:
                    self._waits.append((started, ended))

    def _mark(self) -> Any:
        if self._device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
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
            waits, self._waits = self._waits, []
        for started, ended in waits:
            self._log.record(self._kind, started, ended)
        for started, ended in pending:
            if final:
                ended.synchronize()
            if ended.query():
                seconds += started.elapsed_time(ended) / 1000
                self._log.record_events(self._kind, started, ended)
            else:
                with self._lock:
                    self._spans.append((started, ended))
        if self._watching:
            self.wait.update_total(seconds, float(self._steps))
        self._steps = 0

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        if not self._watching:
            window.pop(SYNC_WAIT, None)

    def close(self) -> None:
        """Remove the forward hooks; a backward already under way is no longer timed."""
        with self._lock:
            self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _sharded_by_fsdp2(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())
