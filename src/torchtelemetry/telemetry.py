"""The `Telemetry` façade: collect every `every` steps, export from rank 0, lose nothing at close."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtelemetry._process import check_same_process, current_pid
from torchtelemetry._started import start_run
from torchtelemetry._startup import TelemetryStartupError, require_process_group
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import Exporter, RunInfo, print_startup_line
from torchtelemetry.report import (
    DEFAULT_LAYER_STATS,
    HostTimer,
    LayerWatch,
    MetricDescriptor,
    PhaseTimer,
    ReportValue,
)
from torchtelemetry.run import RunIdentity

__all__ = ["RunIdentity", "Telemetry", "TelemetryConfig", "TelemetryStartupError"]

logger = logging.getLogger(__name__)


class Telemetry:
    """Metrics on every rank, collected every `every` steps, exported from rank 0 of the group.

    ```python
    telemetry = Telemetry({"train": {"loss": WeightedMeanMetric()}}, exporters=[PrometheusExporter()])
    for step, batch in enumerate(loader):
        loss, n_tokens = train_step(batch)
        telemetry.metrics["train"]["loss"].update(loss, n_tokens)
        telemetry.step(step, tokens=n_tokens)
    telemetry.close()
    ```

    `step()` does not wait: it schedules a collection every `every` steps and
    exports whatever earlier collections have finished. Only if `max_pending`
    collections are still in flight when the next is due does it wait for the
    oldest (every rank must schedule the same windows, so a window cannot be
    skipped on one rank alone). `close()` collects the last partial window and
    flushes every exporter.

    Building a `Telemetry` is collective: build it on every rank, at the same point
    (rank 0 of `group` exports: see `export_policy`). Every rank that builds it learns within
    `timeout_s` whether every rank started; if one did not (a port in use, a missing extra), every
    rank raises, naming the rank and the cause (`TelemetryStartupError` on the others); a rank that
    never builds it cannot raise, and the ranks that did name it. With `WORLD_SIZE` > 1 in the environment,
    call `torch.distributed.init_process_group()` first.

    Args:
        metrics: nested dicts of Metrics, whose keys name them (`{"train": {"loss": m}}` ->
            `train/loss`); a list, a tuple or a bare Metric raises a `TypeError` saying where.
        exporters: exporters (constructed on every rank; only the group's rank 0 starts them), or a
            comma-separated spec resolved through entry points, with options as literal keyword
            arguments: "console, prometheus(port=9464)" (`exporters_from_spec`).
        config: how to collect and export (`TelemetryConfig`).
        **fields: `TelemetryConfig` fields overriding `config`, e.g. `Telemetry(metrics, every=10)`.
    """

    def __init__(
        self,
        metrics: Any,
        exporters: Sequence[Exporter] | str = (),
        config: TelemetryConfig | None = None,
        **fields: Any,
    ) -> None:
        require_process_group("Telemetry")
        self._pid = current_pid()
        self._thread = threading.get_ident()
        started = start_run(metrics, exporters, config, fields)
        self._started = started
        self.config = started.config
        self.metrics = metrics
        self.every = self.config.every
        self.max_pending = self.config.max_pending
        parts = started.parts
        self.is_exporting = parts.is_exporting
        """Whether this rank exports: rank 0 of the group (`export_policy`)."""
        self.hub = parts.hub
        self._hang_watch, self._collector = started.hang_watch, started.collector
        self._windows = started.windows
        self._signals, self._publisher, self._progress = parts.signals, parts.publisher, parts.progress
        self._closed = self._raised = False
        if self.is_exporting:
            print_startup_line(self.run, self.every, self.hub.exporters)

    @property
    def run(self) -> RunInfo:
        """The run exported (its id: see `run_identity`)."""
        return self._started.run

    @property
    def run_identity(self) -> RunIdentity:
        """The run id every rank agreed on (without the group suffix) and where it came from: `run_id=`,
        the environment, the checkpoint loaded, the progress file, the launcher, or new (README)."""
        return self._started.identity

    @property
    def backpressure_waits(self) -> int:
        """Times `step()` waited because `max_pending` collections were in flight."""
        return self._windows.backpressure_waits

    @property
    def descriptors(self) -> list[MetricDescriptor]:
        """Every name this telemetry exports."""
        return list(self._started.parts.descriptors)

    @property
    def latest(self) -> dict[str, ReportValue]:
        """The last exported values (running totals for counters), on every rank."""
        return self._publisher.latest

    @property
    def latest_step(self) -> int | None:
        """The step of `latest` (None before the first collection)."""
        return self._publisher.latest_step

    # -- the loop -------------------------------------------------------------------------

    def step(self, step: int, **inputs: Any) -> None:
        """Mark the end of training step `step`; schedule and export without waiting.

        Each keyword goes to the signal that takes it (`step_keywords`; the built-in ones:
        docs/signals.md, "The built-in training signals"), e.g. `tokens=` and `samples=` (tensors
        stay on the device), `learning_rate=`, `data_time=` (or time the wait with `data_wait()`).
        None counts as not given; a keyword no signal takes raises a `TypeError` naming those taken.
        """
        self._require_open("step")
        self._windows.stepped(step, inputs)

    @property
    def step_keywords(self) -> frozenset[str]:
        """The keywords `step()` takes: those the signals declare (none with `signals=False`)."""
        return self._signals.keywords if self._signals is not None else frozenset()

    def data_wait(self) -> HostTimer | contextlib.AbstractContextManager[None]:
        """Time the block as waiting for data: `with telemetry.data_wait(): batch = next(batches)`.

        Adds to the current step's `train/data_wait` (host wall time, no device sync), the phase
        "data"; `step(data_time=)` does the same with a duration measured elsewhere.
        """
        if self._signals is None:
            return contextlib.nullcontext()
        return self._signals.data_wait_timer()

    def phase(self, name: str) -> PhaseTimer | HostTimer | contextlib.AbstractContextManager[None]:
        """Time the block as phase `name` of the current step: `with telemetry.phase("forward"): ...`.

        On CUDA, device time between two events recorded on the current stream (read off this
        thread once completed: no sync); otherwise host time. Phases are declared in
        `TelemetryConfig.phases`; "data" is `data_wait()`. Exports seconds per step per rank, over
        ranks min/median/max with the ranks holding them, each phase's share of the step and
        straggler scores (docs/signals.md). With `signals=False` the block is not timed.
        """
        if self._signals is None:
            return contextlib.nullcontext()
        return self._signals.timers.get(name) or self._signals.phase(name)  # phase(): raises, naming it

    def watch_gradient_sync(self, model: torch.nn.Module, *, phase: str = "backward") -> None:
        """Measure how long each rank's backward through `model` waits for the gradient collective.

        `model` is the `DistributedDataParallel` or FSDP2 module (or the module it wraps). Nothing
        of the training changes: no communication hook, a forward hook that marks the outputs'
        gradients and two autograd-engine callbacks per backward, from the last gradient computed
        to the end of the backward (DDP's all-reduce done). Exports `train/sync_wait` per rank; the
        straggler scores take that wait out of `phase`, the declared phase whose block holds the
        collective (`loss.backward()`), so that the ranks that wait are never named, only the one
        they wait for. Without it a multi-rank run names nobody in "backward" (docs/signals.md). Call
        it on every rank before training; `close()` removes the hook. With `signals=False`, nothing.
        """
        self._require_open("watch_gradient_sync")
        if self._signals is not None:
            self._signals.watch_gradient_sync(model, phase)

    def watch_layers(
        self,
        model: torch.nn.Module,
        stats: Sequence[str] = DEFAULT_LAYER_STATS,
        every: int | None = None,
        *,
        layers: Sequence[str] | None = None,
        nonfinite: bool = True,
    ) -> None:
        """Export each layer's gradient and parameter norms and where a NaN was born, on every rank.

        A layer is each module of `model` that directly holds parameters, named by its path (or the
        module paths `layers`, each with every parameter under it). `stats`: "grad_norm",
        "param_norm". The norms are exact under DDP, FSDP2, HSDP and DTensor placements, measured on
        the device at the step that ends each window (or every `every` steps) with no collective
        beyond the window's; with `nonfinite`, every step each layer's output and gradients are
        checked for NaN and Inf, one read of each (docs/signals.md, "Per-layer statistics"). Call it
        once, after wrapping the model, on every rank, before the window it is to start in (and
        before `load_state_dict`): it waits for the collections in flight. `close()` removes its
        hooks. With `signals=False`, nothing.
        """
        self._require_open("watch_layers")
        watch = LayerWatch(layers, stats, every, nonfinite, self.config.group)
        if self._signals is not None:
            self._windows.drain(block=True)  # the windows in flight were laid out without the layers
            self._signals.watch_layers(model, watch)

    def checkpoint_saved(self, step: int) -> None:
        """Mark the checkpoint of `step` as durable (written and committed): for goodput, the
        training up to when `state_dict()` was taken for it reached a checkpoint."""
        self._require_open("checkpoint_saved")
        self._started.checkpoint_saved(step)

    def request_capture(self, rank: int, *, reason: str = "request") -> None:
        """Capture `rank`'s evidence over the next `capture_steps` steps (its profile, every thread's
        stacks, on CUDA its memory snapshot and NCCL's flight record) in `dump_dir`, in a directory
        ending in `reason` (a-z, 0-9, _). Call it on the exporting rank alone (`is_exporting`), from
        any thread there (a callback); the request rides the next window to every rank, counted in
        `train/capture/count{reason="request"}` and within `max_captures` (docs/signals.md, Captures).
        Raises a `RuntimeError` where captures are off or on another rank, a `ValueError` on a bad
        rank or reason."""
        check_same_process(self._pid, "Telemetry.request_capture")
        captures = self._started.parts.captures
        if self._closed or captures is None:
            why = (
                "telemetry is closed"
                if self._closed
                else "captures are off (capture_on=(), or signals=False)"
            )
            raise RuntimeError(f"Telemetry.request_capture: {why}")
        captures.request(rank, reason)

    def schedule_collection(self) -> None:
        """Schedule a collection of the steps since the last one now, without waiting for it.

        `step()` does this every `every` steps; call it where a training framework decides when
        to log (the Hugging Face Trainer's `should_log`). Nothing to do right after a collection.
        Extra collections (this, `flush()`, a checkpoint) do not move the every-`every` grid.
        """
        self._require_open("schedule_collection")
        if self._windows.steps_in_window:
            self._windows.schedule()

    def log(self, values: Mapping[str, ReportValue], step: int) -> None:
        """Export values already on the host (a training framework's own logs) from rank 0, never waiting.

        While collections are in flight, reports keep step order: values logged at the step
        of the newest collection ride in its report, others follow it; otherwise they are
        submitted at once. Free-form names are made legal metric paths by `sanitize_path`
        (`"my loss"` -> `my_loss`, `mfu(%)` -> `mfu_pct`), the one rule of every adapter; a name
        with nothing legal left is skipped with a warning naming it. A name that is one of this
        run's own (a metric of the tree, a built-in signal, `exporter/...`; see `descriptors`), or
        two names that become one path, raise `NameCollisionError` naming them, and nothing of
        the call is exported: a value is never replaced by another under its name.
        """
        self._require_open("log")
        self._publisher.log(values, step)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Collect the current partial window and everything in flight, export it, flush exporters."""
        self._require_open("flush")
        if self._windows.steps_in_window:
            self._windows.schedule()
        self._windows.drain(block=True)
        return self.hub.force_flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Collect and export the last partial window (and goodput of a checkpoint marked after it),
        then close every exporter; the progress file records that the run finished. Idempotent.

        After a failed collection (a rank died or diverged) nothing more is collected: close
        only releases the collector and flushes what was already exported. Afterwards `step`,
        `log`, `flush` and `schedule_collection` raise; the metrics themselves stay usable (a new
        `Telemetry`, `compute()`), so what they are updated with after close is never exported.
        """
        check_same_process(self._pid, "Telemetry.close")
        if self._closed:
            return
        try:
            self._started.collect_last()
        finally:
            self._closed = True
            # A failed collection or a with block that raised: the run did not finish.
            self._started.close(timeout_s, finished=self._windows.failure is None and not self._raised)

    def _require_open(self, op: str) -> None:
        check_same_process(self._pid, f"Telemetry.{op}")
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"Telemetry.{op}: called from thread {threading.current_thread().name!r}, not from the "
                "thread that built this Telemetry; collections snapshot the metrics, so they run on "
                "the thread that updates them (the training thread)"
            )
        if self._closed:
            raise RuntimeError(f"Telemetry.{op}: telemetry is closed; create a new Telemetry")
        failure = self._windows.failure
        if failure is not None:
            raise RuntimeError(
                f"Telemetry.{op}: stopped after a failed collection ({failure}); call close()"
            ) from failure

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        """Close; when the block raised, its exception goes on and a failure of close (a collection
        the other ranks did not join) is logged and noted on it instead of replacing it, and the run
        is not recorded as finished."""
        self._raised = exc is not None
        try:
            self.close()
        except Exception as error:
            if exc is None:
                raise
            failed = f"Telemetry.close() failed too: {type(error).__name__}: {error}"
            logger.error("%s (after %s in its with block)", failed, type(exc).__name__)
            exc.add_note(failed)

    # -- checkpointing (torch.distributed.checkpoint Stateful) ---------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every rank's partial window (local metric states, signals included, gathered into one
        entry that loads at any world size), counter totals, the last step and the steps of the
        current window (and since the last every-`every` collection). Collective: call it on every
        rank, as `torch.distributed.checkpoint` does; called on some ranks only, it raises a
        `RuntimeError` saying so within `timeout_s` on those.

        Waits for collections in flight (and exports them) first, so a restart from this state
        neither loses nor repeats a window, and later windows end at the same steps. Counter totals
        are one JSON string: a fresh `Telemetry` cannot know which counters the saved run had.
        The run id rides along, so that a restart from this state continues the same run.
        """
        check_same_process(self._pid, "Telemetry.state_dict")
        return self._started.state_dict(collect=not self._closed)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`, also one saved at another world size: totals carry over
        whole, the partial window is dealt out to the new ranks (exact for sums, maxima, minima),
        built-in per-rank signals of the partial window are dropped with a warning, and a user's
        `PerRankMetric` holding a partial window raises (see `restore_local_states`).

        The run continues: unless `run_id=` (or `$TORCHTELEMETRY_RUN_ID`) pins another, this launch
        adopts the checkpoint's run id and exports as an attempt of that run (`train/goodput/restarts`
        counts it, once however often this is called).
        """
        check_same_process(self._pid, "Telemetry.load_state_dict")
        self._started.load_state_dict(state)
