"""Set-up: the parts one rank's `Telemetry` is made of, built from its metrics, exporters and config.

Everything here is rank-local (nothing waits on another rank): the group and who exports it, the
run (its id, progress file and goodput: `torchtelemetry.run`), the built-in signals, what the run
exports, and rank 0's started exporters behind the hub. `Telemetry` then agrees with the other
ranks that every rank got this far (and on global rank 0's run id) and binds the collector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry._startup import ExportPolicy, export_policy
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import (
    HEALTH_DESCRIPTORS,
    Exporter,
    ExportHub,
    NullHub,
    RunInfo,
    exporters_from_spec,
    print_window_line,
    prints_every_report,
)
from torchtelemetry.metric import Metric, named_metric_leaves
from torchtelemetry.report import (
    HANG_DESCRIPTORS,
    MetricDescriptor,
    ModelFlops,
    RankSeriesLimit,
    ReportValues,
    SignalContext,
    SignalSet,
    Submit,
    WindowPublisher,
    builtin_signals,
    describe_with_signals,
)
from torchtelemetry.run import (
    CaptureRun,
    CaptureSettings,
    GoodputLedger,
    ProgressFile,
    RunIdentity,
    RunProgress,
    RunTraces,
    flight_recorder_on,
    progress_path,
    resolve_run_identity,
    run_traces,
)
from torchtelemetry.sync import group_rank, group_world_size, resolve_group

__all__ = ["RunParts", "assemble_run", "startup_timeout_s"]


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
    exporters: list[Exporter]
    """The exporters given (started on rank 0 only): the next rank's route for a hang report."""
    publisher: WindowPublisher
    """Turns each collected window into the report the hub exports."""
    progress: RunProgress | None
    """The run's progress file (`TelemetryConfig.progress_file`), written by the exporting rank."""
    goodput: GoodputLedger
    """Goodput's lasting state (the goodput signal exports it)."""
    captures: CaptureRun | None
    """This rank's captures (None: `capture_on` empty, or no signals); the captures signal drives them."""
    traces: RunTraces
    """This rank's traces: the timeline the timers write, and the spans of sampled windows."""

    def submit_hang(self, step: int, values: ReportValues) -> None:
        """Export a hang report, with the captures' values once the rank it names wrote a capture."""
        self.hub.submit(step, values if self.captures is None else self.captures.hang_reported(values))

    def close(self) -> None:
        """Release what set-up started: the exporters (ports, threads), the signals' threads and the
        progress file's writer (the run did not finish)."""
        self.hub.close()
        self.traces.close()
        if self.signals is not None:
            self.signals.close()
        if self.progress is not None:
            self.progress.close(finished=False)


def assemble_run(metrics: Any, exporters: Sequence[Exporter] | str, config: TelemetryConfig) -> RunParts:
    """Build one rank's parts of a run; rank 0 starts its exporters here. What was started is closed
    again when a later step fails."""
    resolved = resolve_group(config.group, op="Telemetry")
    world_size = group_world_size(resolved)
    user_leaves = named_metric_leaves(metrics, op="Telemetry")
    device = user_leaves[0][1].device if user_leaves else torch.device("cpu")
    policy = export_policy(resolved, config.group)
    run, identity, progress = _run_of(config, policy, world_size)
    goodput = GoodputLedger(progress)
    hub: ExportHub | NullHub = NullHub()
    signals = captures = None
    if isinstance(exporters, str):
        exporters = exporters_from_spec(exporters)
    rank = group_rank(resolved)
    traces = run_traces(config, exporters, rank, world_size, policy.exporting, run.run_id, device)
    try:
        captures = _captures(config, resolved, policy.exporting, device, run.run_id)
        signals = _builtin_signals(
            config, world_size, goodput, user_leaves, rank, policy.exporting, device, captures, traces
        )
        signal_metrics = signals.metrics() if signals is not None else {}
        leaves = user_leaves + list(signal_metrics.items())
        ranks = RankSeriesLimit(world_size, config.max_rank_series)
        descriptors = describe_with_signals(metrics, signals, ranks)
        if config.hang_after_s is not None:  # the hang monitor's reports (`torchtelemetry.run`)
            descriptors += HANG_DESCRIPTORS
        if policy.exporting:
            hub = ExportHub(exporters, run=run, queue_size=config.queue_size)
        hub.describe(descriptors)
        publisher = WindowPublisher(
            leaves,
            descriptors,
            signals,
            _reporting(
                hub,
                progress,
                lines=policy.exporting and config.window_lines and not prints_every_report(exporters),
            ),
            ranks,
            reserved=[descriptor.name for descriptor in HEALTH_DESCRIPTORS],
        )
    except BaseException:
        hub.close()
        traces.close()
        if signals is not None:
            signals.close()
        elif captures is not None:
            captures.close()
        if progress is not None:
            progress.close(finished=False)
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
        list(exporters),
        publisher,
        progress,
        goodput,
        captures,
        traces,
    )


def _run_of(
    config: TelemetryConfig, policy: ExportPolicy, world_size: int
) -> tuple[RunInfo, RunIdentity, RunProgress | None]:
    """The run exported, this rank's identity of it, and its progress file (read by the exporting
    rank for the id of a run that did not finish there, written by it from now on)."""
    given = config.progress_file
    file = ProgressFile(progress_path(given, policy.run_id_suffix)) if given is not None else None
    record = file.read() if file is not None and policy.exporting else None
    identity = resolve_run_identity(config.run_id, record, policy.run_id_suffix)
    run = RunInfo(
        run_id=identity.run_id + policy.run_id_suffix, world_size=world_size, config=dict(config.run_config)
    )
    progress = RunProgress(file, run.run_id, writes=policy.exporting) if file is not None else None
    return run, identity, progress


def _reporting(hub: ExportHub | NullHub, progress: RunProgress | None, *, lines: bool) -> Submit:
    """`hub.submit`, telling the progress file the step of each report, and printing each window's
    short line with `lines`."""
    if progress is None and not lines:
        return hub.submit

    def submit(
        step: int, values: ReportValues, timestamp: float | None = None, *, window: ReportValues | None = None
    ) -> None:
        hub.submit(step, values, timestamp, window=window)
        if progress is not None:
            progress.reported(step)
        if lines and window is not None:
            print_window_line(step, values, window)

    return submit


def startup_timeout_s(config: TelemetryConfig | None, fields: Mapping[str, Any]) -> float:
    """The start-up bound when the configuration itself could not be built."""
    timeout_s = fields.get("timeout_s", config.timeout_s if config is not None else None)
    return float(timeout_s) if isinstance(timeout_s, (int, float)) and timeout_s > 0 else 300.0


def _captures(
    config: TelemetryConfig,
    resolved: dist.ProcessGroup | None,
    exporting: bool,
    device: torch.device,
    run_id: str,
) -> CaptureRun | None:
    settings = CaptureSettings.of(config)
    if settings is None:
        return None
    backend = None if resolved is None else str(dist.get_backend(resolved))
    return CaptureRun(
        settings,
        rank=group_rank(resolved),
        world_size=group_world_size(resolved),
        exporting=exporting,
        max_pending=config.max_pending,
        device=device,
        run_id=run_id,
        flight_recorder=flight_recorder_on(backend),
    )


def _builtin_signals(
    config: TelemetryConfig,
    world_size: int,
    goodput: GoodputLedger,
    user_leaves: list[tuple[str, Metric]],
    rank: int,
    exporting: bool,
    device: torch.device,
    captures: CaptureRun | None,
    traces: RunTraces,
) -> SignalSet | None:
    if not config.signals:
        return None
    context = SignalContext(world_size, rank, device, config.max_rank_series)
    return SignalSet(
        builtin_signals(
            context,
            leaves=user_leaves,
            flops=ModelFlops.resolve(
                config.flops_per_token, config.flops_per_sample, config.peak_flops, device, warn=exporting
            ),
            phases=config.phases,
            straggler_top_k=config.straggler_top_k,
            nonfinite=config.nonfinite,
            spike_sigma=config.spike_sigma,
            spike_windows=config.spike_windows,
            goodput=goodput,
            nvml=config.nvml,
            every=config.every,
            max_layer_series=config.max_layer_series,
            captures=captures,
            trace_ranks=traces.trace_ranks,
            traces=traces,
            timeline=traces.log,
        )
    )
