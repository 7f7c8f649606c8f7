"""Lightning: a callback that collects on every rank, and a logger that exports `self.log` values."""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torchtelemetry._optional import import_optional
from torchtelemetry.export import Exporter
from torchtelemetry.integrations._metric_logger import TelemetryMetricLogger, check_log_prefix
from torchtelemetry.integrations._setup import build_telemetry, watch_gradient_sync
from torchtelemetry.metric import Metric, WeightedMeanMetric
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

pl = import_optional("lightning.pytorch", "lightning", "LightningTelemetryCallback")

__all__ = ["LIGHTNING_PREFIX", "LightningTelemetryCallback", "LightningTelemetryLogger"]

LIGHTNING_PREFIX = "lightning/"
"""Where `LightningTelemetryLogger` puts what the LightningModule logs (`self.log`)."""

logger = logging.getLogger(__name__)

UpdateFn = Callable[[Mapping[str, Metric], Any, Any], None]
"""`update(metrics, outputs, batch)`: update the metrics from a training step's outputs and batch."""


class LightningTelemetryCallback(pl.Callback):
    """Coalesced, non-blocking metric collection for a Lightning `Trainer`, on every rank.

    ```python
    metrics = {"accuracy": AccuracyMetric()}
    telemetry = LightningTelemetryCallback(
        metrics,
        exporters=[PrometheusExporter()],
        update=lambda m, outputs, batch: m["accuracy"].update(outputs["preds"], batch[1]),
    )
    trainer = L.Trainer(callbacks=[telemetry], logger=LightningTelemetryLogger(telemetry))
    ```

    At `setup` (fit) it builds a `Telemetry` bound to the strategy's process
    group (the default group under DDP; `group=` picks another), with the
    LightningModule's and DataModule's hyperparameters as the run config. After
    every training batch it updates the loss from the batch's `outputs` (on the
    device, no `.item()`) and calls `update`; after every optimizer step it
    calls `Telemetry.step`, which every `every` steps schedules one coalesced
    collection of all metrics. At `on_fit_start` it measures each rank's wait for
    the gradient collective in the strategy's wrapped model (`train/sync_wait`,
    `Telemetry.watch_gradient_sync`). `teardown` collects the last partial window and
    closes the exporters; on an exception the reports already collected are
    flushed (the partial window is not: other ranks may be gone). The callback's
    `state_dict` (saved in Lightning checkpoints) holds the metric state and
    counter totals.

    Args:
        metrics: torchtelemetry metrics by name (paths such as "train/accuracy" or nested dicts).
        exporters: exporters (constructed on every rank, started on global rank 0 only) or a spec string.
        config: how to collect and export (`TelemetryConfig`). Without `config` or `every`, a
            collection every `log_every_n_steps` optimizer steps of the Trainer; without `run_id`,
            the run's own (`Telemetry.run_identity`: a resumed fit continues its checkpoint's
            run); `run_config` goes on top of the modules' hyperparameters.
        loss: name under which the mean of the training loss over the window's batches and all
            ranks is exported; None to leave the loss out.
        update: `update(metrics, outputs, batch)`, called after every training batch.
        **fields: `TelemetryConfig` fields overriding `config` (every, group, run_id, ...).
    """

    def __init__(
        self,
        metrics: Mapping[str, Any] | None = None,
        exporters: Sequence[Exporter] | str = (),
        config: TelemetryConfig | None = None,
        *,
        loss: str | None = "train/loss",
        update: UpdateFn | None = None,
        **fields: Any,
    ) -> None:
        metrics = dict(metrics or {})
        if loss is not None and loss in metrics:
            raise ValueError(
                f"LightningTelemetryCallback: metrics already has {loss!r}, the name of the loss; "
                "pass loss=<another name> or loss=None"
            )
        self.config = (config or TelemetryConfig()).replace(**fields)
        """How to collect and export; `every` and `run_id` are settled at `setup`."""
        self._every_from_trainer = config is None and "every" not in fields
        self.metrics = metrics
        self.loss_metric = WeightedMeanMetric(description="Training loss") if loss is not None else None
        self._tree = {**metrics, loss: self.loss_metric} if loss is not None else metrics
        self.exporters = exporters
        self.update = update
        self.telemetry: Telemetry | None = None
        """The run's `Telemetry` between `setup` and `teardown` of a fit, else None."""
        self._pending_state: Mapping[str, Any] | None = None
        self.global_step = 0
        """The trainer's global step (optimizer steps) at the last training batch; every report's step."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Build the `Telemetry` (collective: every rank of the group binds the collector)."""
        if stage != "fit":
            return
        launched = os.environ.get("WORLD_SIZE")
        if launched is not None and launched.isdigit() and int(launched) != trainer.world_size:
            raise RuntimeError(
                f"LightningTelemetryCallback: the launcher started WORLD_SIZE={launched} processes but the "
                f"Trainer runs {trainer.world_size} (devices x num_nodes), so each process would be a run "
                "of its own; under torchrun pass Trainer(devices=<--nproc_per_node>, strategy='ddp'), or "
                "run `python script.py` and let Lightning start its processes"
            )
        every = {"every": max(trainer.log_every_n_steps, 1)} if self._every_from_trainer else {}
        self.telemetry = build_telemetry(
            "LightningTelemetryCallback",
            self._tree,
            self.exporters,
            self.config,
            device=trainer.strategy.root_device,
            framework_config=_hparams(trainer, pl_module),
            run_id=self.config.run_id,
            **every,
        )
        try:
            for telemetry_logger in trainer.loggers:
                if (
                    isinstance(telemetry_logger, LightningTelemetryLogger)
                    and telemetry_logger.callback is self
                ):
                    check_log_prefix(telemetry_logger.prefix, self.telemetry, "LightningTelemetryLogger")
        except ValueError:
            telemetry, self.telemetry = self.telemetry, None
            telemetry.close()  # every rank fails the same check: the close is collective on all of them
            raise
        self.global_step = trainer.global_step
        if self._pending_state is not None:
            self.telemetry.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Measure each rank's wait for the gradient collective in the strategy's wrapped model."""
        if self.telemetry is not None:
            watch_gradient_sync(self.telemetry, trainer.strategy.model or pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Update the metrics; after an optimizer step, `Telemetry.step` (a collection every `every`)."""
        if self.telemetry is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self.loss_metric is not None and isinstance(loss, torch.Tensor):
            self.loss_metric.update(loss.detach())
        if self.update is not None:
            self.update(self.metrics, outputs, batch)
        if trainer.global_step != self.global_step:
            self.global_step = trainer.global_step
            self.telemetry.step(trainer.global_step, learning_rate=_learning_rate(trainer))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Collect the last partial window, export it and close the exporters (every rank)."""
        if stage == "fit" and self.telemetry is not None:
            telemetry, self.telemetry = self.telemetry, None
            telemetry.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Flush the reports already collected to the exporters (rank-local: no collective)."""
        if self.telemetry is not None:
            self.telemetry.hub.force_flush()

    def state_dict(self) -> dict[str, Any]:
        """Metric state and counter totals; exports the current window first (collective, every rank)."""
        if self.telemetry is None:
            return dict(self._pending_state or {})
        self.telemetry.flush()
        return self.telemetry.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the metric state and counter totals (kept until `setup` if it comes first)."""
        if not state_dict:
            return
        if self.telemetry is None:
            self._pending_state = state_dict
        else:
            self.telemetry.load_state_dict(state_dict)


class LightningTelemetryLogger(pl.loggers.Logger):
    """Sends what the LightningModule logs with `self.log` to the exporters of a `LightningTelemetryCallback`.

    Lightning reduces and reads those values itself (a blocking all-reduce per
    `sync_dist=True` metric); this logger only hands the results to the
    exporters, from global rank 0, without waiting. Values logged while a
    collection is in flight go out in that collection's report. Hyperparameters
    become the run config when the callback builds the run at `setup`; ones
    logged later are reported in a warning, since the exporters have started.

    Every logged name keeps its own value under `prefix` (`self.log("train_loss")` is
    `lightning/train_loss`, `self.log("train/loss")` `lightning/train/loss`, Lightning's
    `epoch` `lightning/epoch`), so it never collides with the callback's metrics (its
    `train/loss`) or the built-in signals. The callback's `setup` raises `ValueError` when
    the prefix is empty or a metric of the run is named under it.

    Args:
        callback: the callback whose `Telemetry` exports the values.
        prefix: prepended to every logged name.
    """

    def __init__(self, callback: LightningTelemetryCallback, *, prefix: str = LIGHTNING_PREFIX) -> None:
        super().__init__()
        self.callback = callback
        self.prefix = prefix
        self._metric_logger: TelemetryMetricLogger | None = None
        self._warned: set[str] = set()

    @property
    def name(self) -> str:
        return "torchtelemetry"

    @property
    def version(self) -> str | None:
        """The run id, once the callback has built the run."""
        telemetry = self.callback.telemetry
        return telemetry.run.run_id if telemetry is not None else self.callback.config.run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Export `metrics` from rank 0 without waiting (dropped, with a warning, outside a fit).

        They are reported at the trainer's global step, the step of the collections, not at
        Lightning's logging step (which counts from 0), so a batch's logs join its collection.
        """
        metric_logger = self._logger("log_metrics")
        if metric_logger is not None:
            metric_logger.log(metrics, self.callback.global_step)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Add `params` to the run config (before `setup`), else warn about the ones it lacks."""
        values = vars(params) if isinstance(params, Namespace) else dict(params)
        telemetry = self.callback.telemetry
        if telemetry is None:
            config = self.callback.config
            self.callback.config = config.replace(run_config={**config.run_config, **values})
            return
        late = sorted(str(key) for key in values if key not in telemetry.run.config)
        if late and "hyperparams" not in self._warned:
            self._warned.add("hyperparams")
            logger.warning(
                "LightningTelemetryLogger: hyperparameters %s were logged after the exporters started and "
                "are not in the run config; pass them to LightningTelemetryCallback(run_config=...)",
                late,
            )

    def finalize(self, status: str) -> None:
        """Deliver what was exported so far (the callback's `teardown` closes the exporters)."""
        telemetry = self.callback.telemetry
        if telemetry is not None:
            telemetry.hub.force_flush()

    def _logger(self, op: str) -> TelemetryMetricLogger | None:
        telemetry = self.callback.telemetry
        if telemetry is None:
            if op not in self._warned:
                self._warned.add(op)
                logger.warning(
                    "LightningTelemetryLogger.%s: no run (the callback builds it at fit setup and closes it "
                    "at teardown); values dropped",
                    op,
                )
            return None
        if self._metric_logger is None or self._metric_logger.telemetry is not telemetry:
            self._metric_logger = TelemetryMetricLogger(telemetry, prefix=self.prefix)
        return self._metric_logger


def _hparams(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    datamodule = trainer.datamodule
    return {**(datamodule.hparams_initial if datamodule is not None else {}), **pl_module.hparams_initial}


def _learning_rate(trainer: pl.Trainer) -> float | None:
    if not trainer.optimizers:
        return None
    lr = trainer.optimizers[0].param_groups[0].get("lr")
    return lr if isinstance(lr, float) else None
