"""Hugging Face `Trainer`: `TrainerTelemetryCallback` collects where the Trainer logs and exports its logs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchtelemetry._optional import import_optional
from torchtelemetry.export import Exporter
from torchtelemetry.integrations._torchtitan import TelemetryMetricLogger
from torchtelemetry.metric import metric_leaves
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

transformers = import_optional("transformers", "transformers", "TrainerTelemetryCallback")

__all__ = ["TrainerTelemetryCallback"]


class TrainerTelemetryCallback(transformers.TrainerCallback):
    """Coalesced metric collection and export for a Hugging Face `Trainer`, on every process.

    ```python
    metrics = {"train/label_tokens": SumMetric(kind="counter")}
    trainer = Trainer(model=model, args=args, train_dataset=dataset, compute_loss_func=loss_and_update)
    trainer.add_callback(TrainerTelemetryCallback(metrics, exporters=[PrometheusExporter()]))
    ```

    Update `metrics` where the values are, on the device (in `compute_loss_func`
    or a `Trainer` subclass). At `on_train_begin` the callback builds a
    `Telemetry` (every process binds the collector). At every `on_step_end` it
    calls `Telemetry.step`, and when the Trainer is about to log (its
    `logging_steps` / `logging_strategy`) it schedules one coalesced collection
    of all metrics, without waiting. The Trainer's own logs (`on_log`, and
    evaluation metrics from `on_evaluate`) reach the exporters too, in the same
    report as that step's collection. Only world process zero exports.
    `on_train_end` exports the last partial window and flushes the exporters;
    they stay open for later `evaluate()` logs until `close()`.

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
        prefix: str = "",
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
        self._reports_learning_rate = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Build the `Telemetry` on every process (binding the collector is collective)."""
        self.close()
        for _, metric in metric_leaves(self.metrics, op="TrainerTelemetryCallback"):
            metric.to(args.device)
        config = self.config.replace(
            every=max(state.max_steps, 1),  # never due by itself: on_step_end collects when the Trainer logs
            run_config={**args.to_sanitized_dict(), **self.config.run_config},
        )
        self.telemetry = Telemetry(self.metrics, self.exporters, config)
        self._logs = TelemetryMetricLogger(self.telemetry, prefix=self.prefix)

    def on_step_end(
        self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any
    ) -> None:
        """`Telemetry.step`; one collection when the Trainer is about to log (every process)."""
        if self.telemetry is None:
            return
        learning_rate = _learning_rate(lr_scheduler)
        self._reports_learning_rate = learning_rate is not None and self.telemetry.config.signals
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
        """Export the Trainer's logs from world process zero, with the collection of this step.

        Its `learning_rate` is left out when the built-in `train/learning_rate` signal reports it.
        """
        if self._logs is not None and logs:
            if self._reports_learning_rate:
                logs = {key: value for key, value in logs.items() if key != "learning_rate"}
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


def _learning_rate(lr_scheduler: Any) -> float | None:
    if lr_scheduler is None:
        return None
    try:
        lr = lr_scheduler.get_last_lr()[0]
    except (AttributeError, IndexError, RuntimeError):
        return None
    return lr if isinstance(lr, float) else None
