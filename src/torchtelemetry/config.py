"""`TelemetryConfig`: how a `Telemetry` collects and exports, taken by `Telemetry` and every adapter."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchtelemetry.collect import check_collection_limits
from torchtelemetry.sync import GroupLike

__all__ = ["TelemetryConfig"]


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    """How a `Telemetry` collects and exports; `Telemetry` and every framework adapter take it."""

    every: int = 10
    """Steps per window: a collection every this many steps."""
    group: GroupLike = None
    """Ranks to reduce over: a ProcessGroup, a 1-D DeviceMesh, (mesh, dim), or None (the default group)."""
    run_id: str | None = None
    """Stable run id (Prometheus `run` label, OTel instance id, W&B run id); default
    `$TORCHTELEMETRY_RUN_ID`, else a new one."""
    run_config: Mapping[str, Any] = field(default_factory=dict)
    """Hyperparameters handed to exporters with the run (the W&B run config, OTel resource)."""
    signals: bool = True
    """Add the built-in signals (step time and data wait per rank, tokens, samples, throughput,
    model FLOPs, learning rate, peak memory and the CUDA allocator's detail)."""
    max_rank_series: int = 64
    """Above this many ranks, every value per rank (step time, data wait, a `PerRankMetric`) is
    exported as min/median/max over ranks (a counter: its total over ranks) instead of one series
    per rank (0: always), so the series a run exports do not grow with its ranks. The ranks holding
    the min and max step time are exported either way, as values."""
    flops_per_token: float | None = None
    """Model FLOPs of training on one token (forward and backward, e.g. 6 x parameters plus
    attention); exports `train/tflops_per_second` and `train/mfu` from `step(tokens=)`."""
    flops_per_sample: float | None = None
    """As `flops_per_token`, per sample counted by `step(samples=)`; give one of the two."""
    peak_flops: float | None = None
    """Peak FLOP/s of one accelerator for `train/mfu`; default: the CUDA device's dense BF16 peak
    from `torchtelemetry.report.PEAK_FLOPS` (no MFU when the device is not listed)."""
    timeout_s: float = 300.0
    """Bound on one collection: a dead or missing rank raises instead of hanging."""
    max_pending: int = 2
    """Collections in flight before `step()` waits for the oldest (the collector's ring of slots
    has this many)."""
    queue_size: int = 8
    """Reports buffered per exporter before the oldest is dropped."""

    def __post_init__(self) -> None:
        check_collection_limits("TelemetryConfig.", timeout_s=self.timeout_s, max_pending=self.max_pending)
        for key in ("every", "queue_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"TelemetryConfig.{key} must be at least 1, got {getattr(self, key)}")
        if self.max_rank_series < 0:
            raise ValueError(
                f"TelemetryConfig.max_rank_series must be at least 0, got {self.max_rank_series}"
            )
        for key in ("flops_per_token", "flops_per_sample", "peak_flops"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"TelemetryConfig.{key} must be a positive number, got {value}")
        if self.flops_per_token is not None and self.flops_per_sample is not None:
            raise ValueError(
                "TelemetryConfig.flops_per_token and flops_per_sample are both set; give FLOPs per token "
                "or per sample, not both"
            )

    def replace(self, **fields: Any) -> TelemetryConfig:
        """A copy with `fields` changed; unknown names raise a TypeError listing the valid ones."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"TelemetryConfig: unknown field(s) {unknown}; valid fields are "
                f"{[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **fields) if fields else self
