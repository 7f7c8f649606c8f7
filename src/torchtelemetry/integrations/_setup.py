"""The set-up every framework adapter shares: the metrics on the framework's device, the
framework's config under the run's, and the `Telemetry` built over them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtelemetry.export import Exporter
from torchtelemetry.metric import metric_leaves
from torchtelemetry.telemetry import Telemetry, TelemetryConfig

__all__ = ["build_telemetry"]


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
