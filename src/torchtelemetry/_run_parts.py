"""Set-up: the parts one rank's `Telemetry` is made of, built from its metrics, exporters and config.

Everything here is rank-local (nothing waits on another rank): the group and who exports it, the
run, the built-in signals, what the run exports, and rank 0's started exporters behind the hub.
`Telemetry` then agrees with the other ranks that every rank got this far (and on global rank 0's
run id) and binds the collector.

A run outlives its processes: it crashes and resumes many times, and each launch is an attempt of
it, so its id (the `run` label of every series) must survive restarts. In order:

1. `run_id=` (`TelemetryConfig.run_id`), else `$TORCHTELEMETRY_RUN_ID`: pinned, nothing replaces it;
2. the checkpoint: `Telemetry.state_dict()` carries the id, `load_state_dict()` adopts it;
3. `progress_file`: the id the run's last attempt wrote there (read by the exporting rank);
4. the launcher: torchrun's rendezvous id (`$TORCHELASTIC_RUN_ID`, unless "none"), else Slurm's job
   id (`slurm-$SLURM_JOB_ID`: a requeued job keeps it, `$SLURM_RESTART_COUNT` counts its attempts);
5. else a new id.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchtelemetry._startup import export_policy
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import (
    HEALTH_DESCRIPTORS,
    RUN_ID_ENV,
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
    ProgressFile,
    RankSeriesLimit,
    SignalContext,
    SignalSet,
    WindowPublisher,
    builtin_signals,
    describe_with_signals,
    progress_path,
)
from torchtelemetry.sync import group_rank, group_world_size, resolve_group

__all__ = [
    "RunIdentity",
    "RunParts",
    "assemble_run",
    "launcher_run_id",
    "resolve_run_identity",
    "startup_timeout_s",
]


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """A run id (without the group suffix) and where it came from (see the module)."""

    run_id: str
    source: str
    """"argument", "environment", "checkpoint", "progress_file", "launcher" or "new"."""

    @property
    def pinned(self) -> bool:
        """Given by the user (`run_id=`, `$TORCHTELEMETRY_RUN_ID`): a checkpoint does not replace it."""
        return self.source in ("argument", "environment")


def launcher_run_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The launcher's id of the job, the same in each of its attempts: torchrun's rendezvous id,
    else Slurm's job id (`slurm-<id>`); None outside a launcher that names its jobs."""
    rendezvous = environ.get("TORCHELASTIC_RUN_ID", "")
    if rendezvous and rendezvous != "none":
        return rendezvous
    job = environ.get("SLURM_JOB_ID", "")
    return f"slurm-{job}" if job else None


def resolve_run_identity(
    given: str | None,
    progress: ProgressFile | None,
    run_id_suffix: str,
    environ: Mapping[str, str] = os.environ,
) -> RunIdentity:
    """This rank's run id before the ranks agree on global rank 0's (see the module); `progress` is
    its group's progress file, whose id carries `run_id_suffix`."""
    if given:
        return RunIdentity(given, "argument")
    if environ.get(RUN_ID_ENV):
        return RunIdentity(environ[RUN_ID_ENV], "environment")
    record = progress.read() if progress is not None else None
    if record is not None and record[0].endswith(run_id_suffix) and record[0] != run_id_suffix:
        return RunIdentity(record[0][: len(record[0]) - len(run_id_suffix)], "progress_file")
    launcher = launcher_run_id(environ)
    if launcher is not None:
        return RunIdentity(launcher, "launcher")
    return RunIdentity(RunInfo.create().run_id, "new")


@dataclass(slots=True)
class RunParts:
    """One rank's parts of a run."""

    run: RunInfo
    """The run exported, its id suffixed for a group smaller than the world (`export_policy`)."""
    identity: RunIdentity
    """This rank's run id before the ranks agree, and its source."""
    run_id_suffix: str
    """What the group adds to the run id (`export_policy`)."""
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
    given_progress = config.progress_file
    progress = progress_path(given_progress, policy.run_id_suffix) if given_progress is not None else None
    signals = _builtin_signals(config, world_size, progress, user_leaves, group_rank(resolved), device)
    hub: ExportHub | NullHub = NullHub()
    try:
        reader = signals.progress if signals is not None and policy.exporting else None
        identity = resolve_run_identity(config.run_id, reader, policy.run_id_suffix)
        run_id = identity.run_id + policy.run_id_suffix
        run = RunInfo(run_id=run_id, world_size=world_size, config=dict(config.run_config))
        if signals is not None:
            signals.adopt_run(run.run_id)
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
    return RunParts(
        run,
        identity,
        policy.run_id_suffix,
        policy.exporting,
        user_leaves,
        leaves,
        signals,
        descriptors,
        hub,
        publisher,
    )


def startup_timeout_s(config: TelemetryConfig | None, fields: Mapping[str, Any]) -> float:
    """The start-up bound when the configuration itself could not be built."""
    timeout_s = fields.get("timeout_s", config.timeout_s if config is not None else None)
    return float(timeout_s) if isinstance(timeout_s, (int, float)) and timeout_s > 0 else 300.0


def _builtin_signals(
    config: TelemetryConfig,
    world_size: int,
    progress: os.PathLike[str] | None,
    user_leaves: list[tuple[str, Metric]],
    rank: int,
    device: torch.device,
) -> SignalSet | None:
    if not config.signals:
        return None
    context = SignalContext(world_size, rank, device, config.max_rank_series)
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
            progress_file=progress,
            nvml=config.nvml,
            every=config.every,
            max_layer_series=config.max_layer_series,
        )
    )
