"""The set-up every framework adapter shares: the metrics on the framework's device, the
framework's config under the run's, and the `Telemetry` built over them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtelemetry.export import Exporter
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import DEFAULT_SYNC_PHASE
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

__all__ = ["build_telemetry", "watch_gradient_sync"]


def build_telemetry(
    owner: str,
    metrics: Mapping[str, Any],
    exporters: Sequence[Exporter] | str,
    config: TelemetryConfig,
    *,
    device: torch.device | str,
    framework_config: Mapping[str, Any] | None = None,
    **fields: Any,
) -> Telemetry:
    """Move every metric of `metrics` to `device` and build the run's `Telemetry` (collective: every rank).

    `config.run_config` goes on top of `framework_config` (the framework's hyperparameters or
    arguments); `fields` override the config's other fields (`every`, `run_id`). `owner` names the
    adapter in errors about the metric tree.
    """
    for _, metric in metric_leaves(metrics, op=owner):
        metric.to(device)
    config = config.replace(run_config={**(framework_config or {}), **config.run_config}, **fields)
    return Telemetry(metrics, exporters, config)


def watch_gradient_sync(telemetry: Telemetry, model: torch.nn.Module) -> None:
    """Measure the wait for `model`'s gradient collective where the default phase "backward" is timed
    (a run that declared other phases names the one holding it itself: `watch_gradient_sync(model,
    phase=...)`)."""
    if DEFAULT_SYNC_PHASE in telemetry.config.phases:
        telemetry.watch_gradient_sync(model, phase=DEFAULT_SYNC_PHASE)
