"""`TelemetryConfig`: how a `Telemetry` collects and exports, taken by `Telemetry` and every adapter."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchtelemetry.collect import DEFAULT_MAX_PENDING, DEFAULT_TIMEOUT_S, check_collection_limits
from torchtelemetry.report import (
    CAPTURE_TRIGGERS,
    DEFAULT_MAX_LAYER_SERIES,
    DEFAULT_PHASES,
    DEFAULT_SPIKE_SIGMA,
    DEFAULT_SPIKE_WINDOWS,
    DEFAULT_TOP_K,
    MIN_HISTORY,
    check_phase_names,
)
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
    `$TORCHTELEMETRY_RUN_ID`, else the run's own, kept across restarts: the checkpoint's, the
    progress file's, the launcher's job id, or a new one (`Telemetry.run_identity`)."""
    run_config: Mapping[str, Any] = field(default_factory=dict)
    """Hyperparameters handed to exporters with the run (the W&B run config, OTel resource)."""
    signals: bool = True
    """Add the built-in signals (step time and data wait per rank, tokens, samples, throughput,
    model FLOPs, learning rate, peak memory and the CUDA allocator's detail) and the health signals
    (phases and stragglers, non-finite counts, spikes, memory health, goodput, GPU health). Hang
    detection is not one of them: `hang_after_s` turns it on and off."""
    phases: Sequence[str] = DEFAULT_PHASES
    """Sections `Telemetry.phase(name)` times, per rank (the data wait is always the phase "data");
    every rank declares the same, as their times ride the window's collective."""
    straggler_top_k: int = DEFAULT_TOP_K
    """How many stragglers `train/straggler/top_rank` names at most (ranks above their phase's
    threshold two windows running, docs/signals.md)."""
    nonfinite: Sequence[str] | None = None
    """Paths of the metrics whose inputs the health sentinel counts non-finite values of (and
    spike-scores); None: every metric whose name ends in `loss`."""
    spike_sigma: float = DEFAULT_SPIKE_SIGMA
    """A watched metric's window value is a spike above its recent mean plus this many standard
    deviations."""
    spike_windows: int = DEFAULT_SPIKE_WINDOWS
    """Windows the spike score's mean and standard deviation are taken over."""
    progress_file: str | os.PathLike[str] | None = None
    """A file the exporting rank rewrites every window (on a thread of its own) with the run id and
    step; after a restart from a checkpoint, the steps it holds past the checkpoint count as
    recomputed, and its run id names the resumed launch's run. A group smaller than the world
    writes `<stem>-group<r><suffix>`. Keep it where the checkpoints are, one per run."""
    nvml: bool = True
    """On CUDA, sample GPU power, temperature, clocks, utilization and throttling through NVML
    (the extra `nvml`) once per window; without NVML one line is logged."""
    max_rank_series: int = 64
    """Above this many ranks, every value per rank (step time, data wait, a `PerRankMetric`) is
    exported as min/median/max over ranks (a counter: its total over ranks) instead of one series
    per rank (0: always), so the series a run exports do not grow with its ranks. The ranks holding
    the min and max step time are exported either way, as values."""
    max_layer_series: int = DEFAULT_MAX_LAYER_SERIES
    """Above this many layers watched (`Telemetry.watch_layers`), the layer norms are exported for
    this many layers only, those of largest gradient norm (non-finite ones first), plus min/median/max
    over every layer, instead of one series per layer (0: only those three)."""
    flops_per_token: float | None = None
    """Model FLOPs of training on one token (forward and backward, e.g. 6 x parameters plus
    attention); exports `train/tflops_per_second` and `train/mfu` from `step(tokens=)`."""
    flops_per_sample: float | None = None
    """As `flops_per_token`, per sample counted by `step(samples=)`; give one of the two."""
    peak_flops: float | None = None
    """Peak FLOP/s of one accelerator for `train/mfu`; default: the CUDA device's dense BF16 peak
    from `torchtelemetry.report.PEAK_FLOPS` (no MFU when the device is not listed)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on one collection: a dead or missing rank raises instead of hanging."""
    max_pending: int = DEFAULT_MAX_PENDING
    """Collections in flight before `step()` waits for the oldest (the collector's ring of slots
    has this many)."""
    queue_size: int = 64
    """Reports buffered per exporter before one is dropped: the oldest of values only logged while
    one is queued (a window's metrics outlast a burst of per-step logs), else the oldest."""
    window_lines: bool = True
    """Print a short line per window to the exporting rank's stderr (step, losses, throughput, a
    health word), unless a `ConsoleExporter` prints every report; the line at start-up saying where
    the reports go is printed either way."""
    hang_after_s: float | None = 300.0
    """A rank that made no progress (no step, no phase entered or left) for this long is hung: the
    exporting rank exports `train/hang/*` naming the rank the others wait for, and every stuck rank
    dumps its stacks to `dump_dir` (docs/signals.md, Hangs). None: no heartbeat."""
    heartbeat_interval_s: float = 1.0
    """How often each rank publishes where it is, and the exporting rank reads every rank's."""
    heartbeat_port: int = 0
    """The port the exporting rank hosts the heartbeat store on, on the process group's interface,
    when the job has no TCP rendezvous store of its own to use (a `file://` init); 0: one the
    kernel picks."""
    dump_dir: str | os.PathLike[str] | None = None
    """Where captures and a hung rank's stacks (and NCCL's flight recorder) are written; None:
    `$TORCHTELEMETRY_DUMP_DIR`, else the current directory. Give every rank the same: the exporting
    rank names the directories in it."""
    capture_on: Sequence[str] = CAPTURE_TRIGGERS
    """The verdicts that capture evidence (a profile of the next `capture_steps` steps, every thread's
    stacks) on the rank they name: "straggler" (`train/straggler/top_rank`, with the median rank of
    its phase as reference), "nonfinite" (the first rank of a non-finite value), "hang" (a stuck
    rank's stacks); "request" alone: `Telemetry.request_capture` only (allowed whenever this is not
    empty); empty: no captures (docs/signals.md, Captures)."""
    capture_steps: int = 5
    """Steps a capture profiles."""
    max_captures: int = 8
    """Captures per run at most; later triggers are counted, not captured."""
    memory_history: bool = False
    """On CUDA, record the allocator's history (a stack per allocation and free: CPU time on every
    one) so that captures hold its memory snapshot (`memory.pickle`)."""
    trace_ranks: int | None = None
    """Ranks each window sends OTLP spans of its steps from: the slowest, the fastest and one rotating
    through the world (docs/signals.md, Traces), to the `OTelExporter`'s traces endpoint. None: 3 when
    an `OTelExporter` is among the exporters (and `signals` is on), else 0; 0 turns traces off."""

    def __post_init__(self) -> None:
        check_collection_limits("TelemetryConfig.", timeout_s=self.timeout_s, max_pending=self.max_pending)
        for key in ("every", "queue_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"TelemetryConfig.{key} must be at least 1, got {getattr(self, key)}")
        if self.max_layer_series < 0:
            raise ValueError(
                f"TelemetryConfig.max_layer_series must be at least 0, got {self.max_layer_series}"
            )
        if self.max_rank_series < 0:
            raise ValueError(
                f"TelemetryConfig.max_rank_series must be at least 0, got {self.max_rank_series}"
            )
        for key in ("flops_per_token", "flops_per_sample", "peak_flops"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"TelemetryConfig.{key} must be a positive number, got {value}")
        check_phase_names(self.phases)
        for key in ("hang_after_s", "heartbeat_interval_s"):
            value = getattr(self, key)
            if (value is not None or key == "heartbeat_interval_s") and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"TelemetryConfig.{key} must be a positive number of seconds, got {value}")
        if self.hang_after_s is not None and self.hang_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"TelemetryConfig.hang_after_s ({self.hang_after_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}): a rank publishes where it is once "
                "per interval, so a shorter bound would call a rank between two heartbeats hung"
            )
        if not (isinstance(self.heartbeat_port, int) and 0 <= self.heartbeat_port <= 65535):
            raise ValueError(
                "TelemetryConfig.heartbeat_port must be a port number from 0 to 65535, got "
                f"{self.heartbeat_port!r}"
            )
        if self.trace_ranks is not None and (
            isinstance(self.trace_ranks, bool)
            or not isinstance(self.trace_ranks, int)
            or self.trace_ranks < 0
        ):
            raise ValueError(
                f"TelemetryConfig.trace_ranks must be None or an integer >= 0, got {self.trace_ranks!r}"
            )
        self._check_captures()
        if self.straggler_top_k < 1:
            raise ValueError(
                f"TelemetryConfig.straggler_top_k must be at least 1, got {self.straggler_top_k}"
            )
        if not (math.isfinite(self.spike_sigma) and self.spike_sigma > 0):
            raise ValueError(f"TelemetryConfig.spike_sigma must be a positive number, got {self.spike_sigma}")
        if self.spike_windows < MIN_HISTORY:
            raise ValueError(
                f"TelemetryConfig.spike_windows must be at least {MIN_HISTORY}, got {self.spike_windows}"
            )
        if self.flops_per_token is not None and self.flops_per_sample is not None:
            raise ValueError(
                "TelemetryConfig.flops_per_token and flops_per_sample are both set; give FLOPs per token "
                "or per sample, not both"
            )

    def _check_captures(self) -> None:
        choices = (*CAPTURE_TRIGGERS, "request")
        if isinstance(self.capture_on, str) or not set(self.capture_on) <= set(choices):
            raise ValueError(
                f"TelemetryConfig.capture_on must be a sequence of {choices} (empty: no captures), got "
                f"{self.capture_on!r}"
            )
        for key in ("capture_steps", "max_captures"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TelemetryConfig.{key} must be an integer of at least 1, got {value!r}")

    def replace(self, **fields: Any) -> TelemetryConfig:
        """A copy with `fields` changed; unknown names raise a TypeError listing the valid ones."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"TelemetryConfig: unknown field(s) {unknown}; valid fields are "
                f"{[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **fields) if fields else self
