"""`TelemetryMetricLogger`: the `log(metrics, step)` / `close()` backend torchtitan-style loops plug in.

It is also what the other adapters hand a framework's own logs to, so every
adapter turns logged values into report values the same way.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.report import ReportValue
from torchtelemetry.telemetry import Telemetry

__all__ = ["TelemetryMetricLogger", "check_log_prefix"]

logger = logging.getLogger(__name__)


class TelemetryMetricLogger:
    """Feeds values a training loop already reduced (loss, grad norm, throughput) to the exporters.

    Implements torchtitan's metric-logger protocol (`BaseLogger`: `log(metrics, step)`
    and `close()`), so such a trainer adds it next to its TensorBoard or W&B
    logger without forking:

    ```python
    telemetry = Telemetry(metrics, exporters=[PrometheusExporter()], every=10)  # every rank
    metric_logger = TelemetryMetricLogger(telemetry)
    for step in range(1, steps + 1):
        ...
        telemetry.step(step)                                # every rank: the coalesced collection
        if step % log_freq == 0:
            metric_logger.log({"loss_metrics/global_avg_loss": loss}, step)   # any rank
    ```

    Numbers, one-element tensors (read with `.item()`: log host values to
    avoid the sync) and mappings of label to number are exported; other values
    (strings, images) are skipped with one warning per name; free-form names are
    made legal metric paths by `Telemetry.log` (`mfu(%)` -> `mfu_pct`). Only
    global rank 0 exports (other ranks' hubs do nothing), so it can be called on
    every rank or on rank 0 alone. Values
    logged while a collection is in flight are exported in that collection's
    report.

    Args:
        telemetry: the run's `Telemetry`.
        prefix: prepended to every name (e.g. "trainer/").
    """

    def __init__(self, telemetry: Telemetry, *, prefix: str = "") -> None:
        self.telemetry = telemetry
        self.prefix = prefix
        self._skipped: set[str] = set()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Export `metrics` at `step` from rank 0, without waiting."""
        values = self.scalars(metrics)
        if values:
            self.telemetry.log(values, step)

    def close(self) -> None:
        """Deliver what was logged (rank-local, no collective).

        The `Telemetry` itself is closed by the loop, on every rank.
        """
        self.telemetry.hub.force_flush()

    def scalars(self, metrics: Mapping[str, Any]) -> dict[str, ReportValue]:
        """The exportable entries of `metrics`, named with the prefix (`Telemetry.log` makes names legal)."""
        out: dict[str, ReportValue] = {}
        for key, raw in metrics.items():
            value = _scalar(raw)
            if value is None:
                self._skip(f"{self.prefix}{key}", f"{type(raw).__name__} values are not exported")
            else:
                out[f"{self.prefix}{key}"] = value
        return out

    def _skip(self, name: str, reason: str) -> None:
        if name not in self._skipped:
            self._skipped.add(name)
            logger.warning("TelemetryMetricLogger: %r skipped: %s", name, reason)


def check_log_prefix(prefix: str, telemetry: Telemetry, owner: str) -> None:
    """Raise `ValueError` unless `prefix` keeps a framework's own log names apart from the run's metrics.

    A framework logs names of its own choosing (`train_loss`, `train/loss`, `epoch`, the Hugging Face
    Trainer's `train_samples_per_second`), some of which the run already exports (the callback's
    `train/loss`, the built-in `train/samples_per_second`). Under a prefix no metric of the run uses,
    they can never collide, so nothing is replaced or dropped while training.
    """
    if not prefix.strip("/"):
        raise ValueError(
            f"{owner}.prefix: must not be empty (got {prefix!r}): the framework's log names would share the "
            "run's namespace (its `train_loss` is the metric train/loss in Prometheus); keep the default or "
            "pass another, e.g. prefix='trainer/'"
        )
    taken = sorted(d.name for d in telemetry.descriptors if d.name.startswith(prefix))
    if taken:
        raise ValueError(
            f"{owner}.prefix: {prefix!r} is where the framework's own logs go, but the run already has "
            f"metrics there ({taken}); rename them or pass another prefix"
        )


def _scalar(value: Any) -> ReportValue | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping) and value:
        labelled = {str(label): _scalar(entry) for label, entry in value.items()}
        if all(isinstance(entry, float) for entry in labelled.values()):
            return labelled  # type: ignore[return-value]
    return None
