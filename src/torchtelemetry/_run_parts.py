"""Set-up: the parts one rank's `Telemetry` is made of, built from its metrics, exporters and config.

Everything here is rank-local (nothing waits on another rank): the group and who exports it, the
run, the built-in signals, what the run exports, and rank 0's started exporters behind the hub.
`Telemetry` then agrees with the other ranks that every rank got this far and binds the collector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchtelemetry._startup import export_policy
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import (
    HEALTH_DESCRIPTORS,
    Exporter,
    ExportHub,
    NullHub,
    RunInfo,
    exporters_from_spec,
)
from torchtelemetry.metric import Metric, metric_leaves
from torchtelemetry.report import (
    HANG_DESCRIPTORS,
    MetricDescriptor,
    ModelFlops,
    RankSeriesLimit,
    SignalContext,
    SignalSet,
    WindowPublisher,
    builtin_signals,
    describe_with_signals,
)
from torchtelemetry.sync import group_rank, group_world_size, resolve_group

__all__ = ["RunParts", "assemble_run", "startup_timeout_s"]


@dataclass(slots=True)
class RunParts:
    """One rank's parts of a run."""

    run: RunInfo
    """The run exported, its id suffixed for a group smaller than the world (`export_policy`)."""
    is_exporting: bool
    """Whether this rank exports: rank 0 of the group."""
    user_leaves: list[tuple[str, Metric]]
    """The user's metrics by path."""
    leaves: list[tuple[str, Metric]]
    """The user's metrics and the built-in signals' metrics: what each window collects."""
    signals: SignalSet | None
    """The built-in signals (None with `signals=False`)."""
    descriptors: list[MetricDescriptor]
    """Every name the run exports."""
    hub: ExportHub | NullHub
    """Rank 0's exporters, started and described; a `NullHub` on the other ranks."""
    publisher: WindowPublisher
    """Turns each collected window into the report the hub exports."""

    def close(self) -> None:
        """Release what set-up started: the exporters (ports, threads) and the signals' threads."""
        self.hub.close()
        if self.signals is not None:
            self.signals.close()


def assemble_run(metrics: Any, exporters: Sequence[Exporter] | str, config: TelemetryConfig) -> RunParts:
    """Build one rank's parts of a run; rank 0 starts its exporters here. What was started is closed
    again when a later step fails."""
    resolved = resolve_group(config.group, op="Telemetry")
    world_size = group_world_size(resolved)
    user_leaves = metric_leaves(metrics, op="Telemetry")
    device = user_leaves[0][1].device if user_leaves else torch.device("cpu")
    policy = export_policy(resolved, config.group)
    run = RunInfo.create(config.run_id, world_size=world_size, config=config.run_config)
    run = RunInfo(run_id=run.run_id + policy.run_id_suffix, world_size=world_size, config=run.config)
    signals = _builtin_signals(config, run, user_leaves, group_rank(resolved), device)
    hub: ExportHub | NullHub = NullHub()
    try:
        signal_metrics = signals.metrics() if signals is not None else {}
        leaves = user_leaves + list(signal_metrics.items())
        ranks = RankSeriesLimit(world_size, config.max_rank_series)
        descriptors = describe_with_signals(metrics, signals, ranks)
        if config.hang_after_s is not None:  # the hang monitor's reports (`_hang_monitor`)
            descriptors += HANG_DESCRIPTORS
        if isinstance(exporters, str):
            exporters = exporters_from_spec(exporters)
        if policy.exporting:
            hub = ExportHub(exporters, run=run, queue_size=config.queue_size)
        hub.describe(descriptors)
        publisher = WindowPublisher(
            leaves,
            descriptors,
            signals,
            hub.submit,
            ranks,
            reserved=[descriptor.name for descriptor in HEALTH_DESCRIPTORS],
        )
    except BaseException:
        hub.close()
        if signals is not None:
            signals.close()
        raise
    return RunParts(run, policy.exporting, user_leaves, leaves, signals, descriptors, hub, publisher)


def startup_timeout_s(config: TelemetryConfig | None, fields: Mapping[str, Any]) -> float:
    """The start-up bound when the configuration itself could not be built."""
    timeout_s = fields.get("timeout_s", config.timeout_s if config is not None else None)
    return float(timeout_s) if isinstance(timeout_s, (int, float)) and timeout_s > 0 else 300.0


def _builtin_signals(
    config: TelemetryConfig,
    run: RunInfo,
    user_leaves: list[tuple[str, Metric]],
    rank: int,
    device: torch.device,
) -> SignalSet | None:
    if not config.signals:
        return None
    context = SignalContext(run.world_size, rank, device, config.max_rank_series)
    return SignalSet(
        builtin_signals(
            context,
            leaves=user_leaves,
            flops=ModelFlops.resolve(
                config.flops_per_token, config.flops_per_sample, config.peak_flops, device
            ),
            phases=config.phases,
            straggler_top_k=config.straggler_top_k,
            nonfinite=config.nonfinite,
            spike_sigma=config.spike_sigma,
            spike_windows=config.spike_windows,
            run_id=run.run_id,
            progress_file=config.progress_file,
            nvml=config.nvml,
        )
    )
