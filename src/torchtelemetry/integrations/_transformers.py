"""Hugging Face `Trainer`: `TrainerTelemetryCallback` collects where the Trainer logs and exports its logs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtelemetry._optional import import_optional
from torchtelemetry.export import Exporter
from torchtelemetry.integrations._metric_logger import TelemetryMetricLogger, check_log_prefix
from torchtelemetry.integrations._setup import build_telemetry, watch_gradient_sync
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

transformers = import_optional("transformers", "transformers", "TrainerTelemetryCallback")

__all__ = ["HF_PREFIX", "TrainerTelemetryCallback"]

HF_PREFIX = "hf/"
"""Where `TrainerTelemetryCallback` puts the Trainer's own logs (`hf/loss`, `hf/train_runtime`, ...)."""


class TrainerTelemetryCallback(transformers.TrainerCallback):
    """Coalesced metric collection and export for a Hugging Face `Trainer`, on every process.

    ```python
    metrics = {"train/label_tokens": SumMetric(kind="counter")}
    trainer = Trainer(model=model, args=args, train_dataset=dataset, compute_loss_func=loss_and_update)
    trainer.add_callback(TrainerTelemetryCallback(metrics, exporters=[PrometheusExporter()]))
    ```

    Update `metrics` where the values are, on the device (in `compute_loss_func`
    or a `Trainer` subclass). At `on_train_begin` the callback builds a
    `Telemetry` (every process binds the collector) and measures each process's
    wait for the gradient collective in the Trainer's model (`train/sync_wait`,
    `Telemetry.watch_gradient_sync`). At every `on_step_end` it
    calls `Telemetry.step`, and when the Trainer is about to log (its
    `logging_steps` / `logging_strategy`) it schedules one coalesced collection
    of all metrics, without waiting. The Trainer's own logs (`on_log`, and
    evaluation metrics from `on_evaluate`) reach the exporters too, in the same
    report as that step's collection, each under `prefix` with its value unchanged
    (`hf/loss`, `hf/learning_rate`, `hf/eval_loss`, and the end-of-training summary
    `hf/train_runtime`, `hf/train_samples_per_second`, ...), so no name of the Trainer
    can collide with the run's metrics or the built-in signals (`train/samples_per_second`);
    `on_train_begin` raises `ValueError` when the prefix is empty or a metric is named under
    it. The built-in `train/learning_rate` is the learning rate the Trainer logs for the
    step: the one the optimizer step used, read before the scheduler steps. Only world
    process zero exports. `on_train_end` exports the last partial window and flushes the
    exporters; they stay open for later `evaluate()` logs until `close()`.

    Args:
        metrics: torchtelemetry metrics by name, updated by the training code.
        exporters: exporters (constructed on every process, started on world process zero) or a spec.
        config: how to collect and export (`TelemetryConfig`); its `run_config` goes on top of the
            `TrainingArguments`. The Trainer decides when to collect, so `every` is not used.
        prefix: prepended to the names of the Trainer's own logs ("loss", "grad_norm", "eval_loss", ...).
        **fields: `TelemetryConfig` fields overriding `config` (group, run_id, ...).
    """

    def __init__(
        self,
        metrics: Mapping[str, Any] | None = None,
        exporters: Sequence[Exporter] | str = (),
        config: TelemetryConfig | None = None,
        *,
        prefix: str = HF_PREFIX,
        **fields: Any,
    ) -> None:
        if "every" in fields:
            raise TypeError(
                "TrainerTelemetryCallback: every is the Trainer's (logging_steps / logging_strategy); "
                "leave it out"
            )
        self.config = (config or TelemetryConfig()).replace(**fields)
        """How to collect and export; collections follow the Trainer's logging."""
        self.metrics = dict(metrics or {})
        self.exporters = exporters
        self.prefix = prefix
        self.telemetry: Telemetry | None = None
        """The run's `Telemetry` from `on_train_begin` until `close()`."""
        self._logs: TelemetryMetricLogger | None = None
        self._last_log: tuple[int, dict[str, Any]] = (-1, {})
        self._learning_rate: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Build the `Telemetry` on every process (binding the collector is collective)."""
        self.close()
        self.telemetry = build_telemetry(
            "TrainerTelemetryCallback",
            self.metrics,
            self.exporters,
            self.config,
            device=args.device,
            framework_config=args.to_sanitized_dict(),
            every=max(state.max_steps, 1),  # never due by itself: on_step_end collects when the Trainer logs
        )
        try:
            check_log_prefix(self.prefix, self.telemetry, "TrainerTelemetryCallback")
        except ValueError:
            self.close()  # every process fails the same check: the close is collective on all of them
            raise
        self._logs = TelemetryMetricLogger(self.telemetry, prefix=self.prefix)
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module):
            watch_gradient_sync(self.telemetry, model)

    def on_optimizer_step(
        self,
        args: Any,
        state: Any,
        control: Any,
        lr_scheduler: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        """Read the learning rate the step used, before the scheduler steps (what the Trainer logs)."""
        self._learning_rate = _learning_rate(lr_scheduler, optimizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """`Telemetry.step`; one collection when the Trainer is about to log (every process)."""
        if self.telemetry is None:
            return
        learning_rate, self._learning_rate = self._learning_rate, None
        self.telemetry.step(state.global_step, learning_rate=learning_rate)
        if control.should_log:
            self.telemetry.schedule_collection()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Collect when the Trainer logs per epoch (`logging_strategy="epoch"`)."""
        if self.telemetry is not None and control.should_log:
            self.telemetry.schedule_collection()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Export the Trainer's logs (under `prefix`) from world process zero, with this step's collection.

        They are read from the Trainer's own record of them (`state.log_history`): callbacks called
        earlier may change `logs` (the Trainer's `PrinterCallback` pops `total_flos`).
        """
        if self._logs is None or not logs:
            return
        record = state.log_history[-1] if state.log_history else {}
        if record.get("step") == state.global_step and all(record.get(k) == v for k, v in logs.items()):
            logs = {key: value for key, value in record.items() if key != "step"}
        self._logs.log(logs, state.global_step)
        self._last_log = (state.global_step, dict(logs))

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Export evaluation metrics the Trainer did not already log at this step."""
        if self._logs is None or not metrics:
            return
        step, logged = self._last_log
        fresh = {
            key: value
            for key, value in metrics.items()
            if step != state.global_step or key not in logged or logged[key] != value
        }
        if fresh:
            self._logs.log(fresh, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Collect and export the last partial window, then flush the exporters (every process)."""
        if self.telemetry is not None:
            self.telemetry.flush()

    def close(self) -> None:
        """Close the `Telemetry` and its exporters; call on every process after the last `evaluate()`."""
        if self.telemetry is not None:
            telemetry, self.telemetry, self._logs = self.telemetry, None, None
            telemetry.close()


def _learning_rate(lr_scheduler: Any, optimizer: Any) -> float | None:
    """The scheduler's last learning rate, else the optimizer's (ReduceLROnPlateau), as the Trainer reads."""
    try:
        if lr_scheduler is not None and not isinstance(
            lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            lr = lr_scheduler.get_last_lr()[0]
        elif optimizer is not None:
            lr = optimizer.param_groups[0]["lr"]
        else:
            return None
    except (AttributeError, IndexError, KeyError, RuntimeError, AssertionError):
        return None
    if isinstance(lr, torch.Tensor):
        lr = lr.item()
    return float(lr) if isinstance(lr, (float, int)) else None
