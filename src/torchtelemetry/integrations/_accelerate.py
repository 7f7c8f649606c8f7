"""accelerate: `TelemetryTracker`, a `GeneralTracker` for `Accelerator(log_with=[...])`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torchtelemetry._optional import import_optional
from torchtelemetry.export import Exporter
from torchtelemetry.integrations._metric_logger import TelemetryMetricLogger
from torchtelemetry.integrations._setup import build_telemetry
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

tracking = import_optional("accelerate.tracking", "accelerate", "TelemetryTracker")
state = import_optional("accelerate.state", "accelerate", "TelemetryTracker")

__all__ = ["TelemetryTracker"]

logger = logging.getLogger(__name__)


class TelemetryTracker(tracking.GeneralTracker):
    """An accelerate tracker whose `Telemetry` collects on every process and exports from the main one.

    ```python
    tracker = TelemetryTracker({"train/loss": WeightedMeanMetric()}, [PrometheusExporter()], every=10)
    accelerator = Accelerator(log_with=[tracker])
    accelerator.init_trackers("my-project", config={"lr": 1e-3})   # the run config
    for step, batch in enumerate(loader, start=1):
        loss = ...
        tracker.metrics["train/loss"].update(loss.detach())
        tracker.telemetry.step(step)                    # every process, before accelerator.log
        accelerator.log({"lr": scheduler.get_last_lr()[0]}, step=step)
    tracker.telemetry.close()                           # every process: the last window
    accelerator.end_training()
    ```

    accelerate calls its trackers on the main process only, but the coalesced
    collection needs every process: the first use of `tracker.telemetry` builds
    the `Telemetry` (collectively, so make it on every process, after
    `init_trackers` so its config becomes the run config), `telemetry.step()`
    runs on every process before `accelerator.log`, and `telemetry.close()` on
    every process before `end_training()`. Values logged at the step of a
    collection go out in its report; strings are skipped. `finish()` (from
    `end_training`) only flushes the exporters.

    Args:
        metrics: torchtelemetry metrics by name, updated by the training loop; moved to the
            process's device when the `Telemetry` is built.
        exporters: exporters (constructed on every process, started on the main one) or a spec.
        config: how to collect and export (`TelemetryConfig`); the `init_trackers` config goes on
            top of its `run_config`.
        **fields: `TelemetryConfig` fields overriding `config` (every, group, run_id, ...).
    """

    name = "torchtelemetry"
    requires_logging_directory = False

    def __init__(
        self,
        metrics: Mapping[str, Any] | None = None,
        exporters: Sequence[Exporter] | str = (),
        config: TelemetryConfig | None = None,
        **fields: Any,
    ) -> None:
        super().__init__()
        self.config = (config or TelemetryConfig()).replace(**fields)
        """How to collect and export; `init_trackers` adds to its `run_config`."""
        self.metrics = dict(metrics or {})
        self.exporters = exporters
        self._telemetry: Telemetry | None = None
        self._logs: TelemetryMetricLogger | None = None

    @property
    def tracker(self) -> Telemetry | None:
        """The `Telemetry`, once built (accelerate's handle on the underlying tracker)."""
        return self._telemetry

    @property
    def telemetry(self) -> Telemetry:
        """The run's `Telemetry`; the first use builds it, so make it on every process."""
        if self._telemetry is None:
            self._build()
        assert self._telemetry is not None
        return self._telemetry

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Keep `values` as the run config of the `Telemetry` built next (warn if it is already built)."""
        if self._telemetry is None:
            self.config = self.config.replace(run_config={**self.config.run_config, **values})
            return
        late = sorted(str(key) for key in values if key not in self._telemetry.run.config)
        if late:
            logger.warning(
                "TelemetryTracker: config keys %s arrived after the exporters started and are not in the "
                "run config; call init_trackers() before using tracker.telemetry",
                late,
            )

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Export `values` from the main process without waiting, in the report of this step's collection."""
        if self._logs is None:
            raise RuntimeError(
                "TelemetryTracker.log: the Telemetry is not built yet; call tracker.telemetry.step() on "
                "every process before accelerator.log()"
            )
        self._logs.log(values, step if step is not None else self._logs.telemetry.latest_step or 0)

    def finish(self) -> None:
        """Flush the exporters (main process only, so no collective: close the `Telemetry` before)."""
        if self._telemetry is not None:
            self._telemetry.hub.force_flush()

    def _build(self) -> None:
        self._telemetry = build_telemetry(
            "TelemetryTracker", self.metrics, self.exporters, self.config, device=state.PartialState().device
        )
        self._logs = TelemetryMetricLogger(self._telemetry)
