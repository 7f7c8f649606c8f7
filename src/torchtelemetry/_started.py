"""One rank's `Telemetry` once every rank started: the start-up across ranks, the run id the ranks
agree on, the checkpoint state of the whole, and the order everything stops in.

`start_run` builds this rank's parts (`_run_parts`, rank-local), agrees with the other ranks that
every rank got this far (and on global rank 0's run id), starts the hang watch and binds the
collector; when any of it fails, what was started is closed again and every rank raises.
`StartedRun` then holds the parts: it re-describes the run to each part that names it when the run id
changes (`adopt_run`), saves and restores their state (`state_dict`, `load_state_dict`), collects the
last window (`collect_last`) and closes them in the order that loses nothing (`close`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtelemetry._run_parts import RunParts, assemble_run, startup_timeout_s
from torchtelemetry._startup import EveryRank, agree_on_start
from torchtelemetry._windows import StepWindows
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import Exporter, RunInfo
from torchtelemetry.report import restore_run_state, run_state
from torchtelemetry.run import HangSettings, HangWatch, RunIdentity, checked_attempt, watch_hangs

__all__ = ["StartedRun", "start_run"]


@dataclass(slots=True)
class StartedRun:
    """One rank's parts of a started `Telemetry` (built by `start_run`)."""

    config: TelemetryConfig
    parts: RunParts
    every_rank: EveryRank
    """The start-up agreement: the bound of the collective calls that check every rank joins."""
    hang_watch: HangWatch | None
    """This rank's heartbeat and hang monitor (None: hang detection off)."""
    collector: AsyncMetricCollector
    """The bound collector of the user's and the signals' metrics."""
    windows: StepWindows
    """The window bookkeeping (the heartbeat's one writer)."""
    identity: RunIdentity
    """The run id every rank agreed on (without the group suffix) and its source."""
    run: RunInfo
    """The run exported under that id, suffixed for a group smaller than the world."""

    def adopt_run(self, identity: RunIdentity) -> None:
        """Export from now on as `identity`'s run (the exporters re-describe it in order with the
        reports), and write the progress file under it."""
        parts = self.parts
        self.identity = identity
        self.run = RunInfo(
            run_id=identity.run_id + parts.run_id_suffix,
            world_size=self.run.world_size,
            config=self.run.config,
        )
        parts.hub.adopt_run(self.run)
        parts.traces.adopt_run(self.run.run_id)
        if self.hang_watch is not None:
            self.hang_watch.adopt_run(self.run)
        if parts.captures is not None:
            parts.captures.adopt_run(self.run.run_id)
        if parts.progress is not None:
            parts.progress.adopt_run(self.run.run_id)

    def collect_last(self) -> None:
        """The training thread left the loop: collect and export the last partial window (and goodput
        of a checkpoint marked after it, captures triggered by it), unless a collection failed."""
        windows = self.windows
        windows.closing()
        if windows.failure is None:
            if windows.steps_in_window:
                windows.schedule(final=True)
            windows.drain(block=True)
            late = self.parts.goodput.late_gauges()
            if self.parts.captures is not None:
                late |= self.parts.captures.late_counts()
            self.parts.publisher.amend(late)

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of `step` is durable: goodput and the traces take note."""
        self.parts.goodput.checkpoint_saved(step)
        self.parts.traces.checkpoint_saved(step)

    def state_dict(self, *, collect: bool) -> dict[str, Any]:
        """Every rank's partial window, the totals and the signals' state (collective), the windows'
        bookkeeping, the run id and the attempt; `collect`: first wait for the collections in flight
        (and export them) and flush the signals (not after close)."""
        self.every_rank.require("Telemetry.state_dict")
        parts = self.parts
        if collect:
            self.windows.drain(block=True)
            self.windows.flush_signals(final=True)
            parts.traces.state_taken(self.windows.last_step)
        return {
            **run_state(parts.leaves, parts.publisher.totals, parts.signals, self.config.group),
            **self.windows.state(),
            "run_id": self.identity.run_id,
            "attempt": parts.traces.attempt,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`, adopting its run id unless this launch's is pinned."""
        saved_run_id = state.get("run_id")
        if saved_run_id is not None and not (isinstance(saved_run_id, str) and saved_run_id):
            raise ValueError(
                f"Telemetry.load_state_dict: run_id must be a non-empty string, got {saved_run_id!r}; "
                "pass the state Telemetry.state_dict() returned"
            )
        saved_attempt = checked_attempt(state.get("attempt", 0))
        if saved_run_id and not self.identity.pinned and saved_run_id != self.identity.run_id:
            self.adopt_run(RunIdentity(saved_run_id, "checkpoint"))
        parts = self.parts
        restore_run_state(
            state, parts.leaves, parts.user_leaves, parts.publisher.totals, parts.signals, self.config.group
        )
        self.windows.load(state)
        parts.traces.resumed(saved_attempt)

    def close(self, timeout_s: float, *, finished: bool) -> None:
        """Stop everything, the last window collected (or a collection failed): the hang watch first
        (its reports go through the hub), then the collector, the traces (every window's verdict is
        in), the exporters, the signals, and the progress file (`finished`: the run finished)."""
        parts = self.parts
        if self.hang_watch is not None:
            self.hang_watch.close(timeout_s)
        parts.publisher.release()  # collections still in flight after a failure must not wait for logs
        self.collector.unbind(timeout_s=timeout_s)
        parts.traces.close(timeout_s)
        parts.hub.close(timeout_s)
        self.every_rank.release()
        if parts.signals is not None:
            parts.signals.close()
        if parts.progress is not None:
            parts.progress.close(finished=finished)


def start_run(
    metrics: Any,
    exporters: Sequence[Exporter] | str,
    config: TelemetryConfig | None,
    fields: Mapping[str, Any],
) -> StartedRun:
    """Start one rank's `Telemetry` (collective, see the module): `config` with `fields` replaced."""
    failure: Exception | None = None
    try:
        configured = (config or TelemetryConfig()).replace(**fields)
        parts = assemble_run(metrics, exporters, configured)
    except Exception as error:
        failure = error
    timeout_s = configured.timeout_s if failure is None else startup_timeout_s(config, fields)
    every_rank = EveryRank(None, timeout_s)
    hang_watch = None
    try:
        every_rank = agree_on_start(
            failure, timeout_s=timeout_s, proposal=None if failure is not None else parts.identity
        )
        hang_watch = watch_hangs(
            HangSettings.of(configured),
            every_rank,
            timers=parts.signals.section_timers if parts.signals is not None else (),
            group=configured.group,
            exporting=parts.is_exporting,
            run=parts.run,
            submit=parts.submit_hang,
            latest_step=lambda: parts.publisher.latest_step,
            exporters=parts.exporters,
            captures=parts.captures.hang if parts.captures is not None else None,
        )
        # Keyed by metric path, so errors (a layout mismatch across ranks) name metrics as the user does.
        collector = AsyncMetricCollector(
            dict(parts.leaves), configured.group, timeout_s=timeout_s, max_pending=configured.max_pending
        ).bind()
    except BaseException:
        if hang_watch is not None:
            hang_watch.close()
        if failure is None:  # started exporters (open ports, threads) must not outlive a failed set-up,
            parts.close()  # nor the signals' threads and their counting in update()
        every_rank.release()
        raise
    windows = StepWindows(
        collector,
        parts.publisher,
        parts.signals,
        every=configured.every,
        beat=hang_watch.publisher.beat if hang_watch is not None else None,
        sections=parts.traces.log if parts.traces.log.keeps else None,
    )
    started = StartedRun(
        configured, parts, every_rank, hang_watch, collector, windows, parts.identity, parts.run
    )
    agreed = every_rank.agreed
    if isinstance(agreed, RunIdentity) and agreed != parts.identity:
        started.adopt_run(agreed)
    return started
