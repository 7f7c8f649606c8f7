"""One rank's traces of a run: spans of the steps that matter, built from times the timers recorded.

Every rank keeps each window's timeline (`SectionLog`: the host times its phase and data-wait
timers, `step()`, the sync wait and a wait for a collection take anyway; on CUDA the phase events,
placed on the host timeline by their reader thread) until the window's verdict: the window's trace
sampling (`TraceSampling`, on the publishing thread of every rank, from the window's reduced
values) names at most `trace_ranks` ranks. A named rank hands the window to its traces thread
(`torchtelemetry-traces`, started when first named), which builds one `train.step` span per step
with a child per timed section (`_trace_spans`) and sends them in one OTLP request (the
`OTelExporter`'s traces endpoint and settings); the other ranks drop it. The training thread makes
no span. The exporting rank also returns the exemplar of the window: the slowest rank's slowest step
(the step that took longest on the exporting rank: in synchronous training every rank's steps take
as long as the slowest rank's), its ids derived as that rank derives them (`_trace_ids`).

The attempt (0 for a run's first launch) rides the checkpoint (`Telemetry.state_dict`): a launch that
loads one is the next attempt, and its spans say so.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import Exporter, OTelExporter, OtlpSpanSender, RunInfo
from torchtelemetry.report import (
    CHECKPOINT_SECTION,
    STEP_SPAN,
    Exemplar,
    HostAnchor,
    SectionLog,
    TraceSample,
    section_kinds,
    wall_time,
)
from torchtelemetry.run._trace_ids import hex_span_id, hex_trace_id, span_id, trace_id
from torchtelemetry.run._trace_spans import TracedWindow, window_spans

__all__ = [
    "checked_attempt",
    "DEFAULT_TRACE_RANKS",
    "LATE_WAIT_S",
    "QUEUED_WINDOWS",
    "TRACES_THREAD",
    "RunTraces",
]

logger = logging.getLogger(__name__)

DEFAULT_TRACE_RANKS = 3
"""`TelemetryConfig.trace_ranks` when an `OTelExporter` is configured: the slowest, fastest, one rotating."""
TRACES_THREAD = "torchtelemetry-traces"
"""The name of the thread that builds and sends a rank's spans."""
QUEUED_WINDOWS = 8
"""Windows waiting to be sent; past it the oldest is dropped (said once)."""
LATE_WAIT_S = 60.0
"""How long the traces thread waits for a window's CUDA phase times to be read."""
_CHECKPOINTS_KEPT = 16


class RunTraces:
    """The traces of one rank (see the module): the `TraceSink` of the window's trace sampling, and
    the timeline `log` the timers write. With `sender` None or `trace_ranks` 0 it keeps nothing,
    sends nothing and starts no thread."""

    def __init__(
        self,
        phases: Sequence[str],
        *,
        rank: int,
        world_size: int,
        exporting: bool,
        run_id: str,
        sender: OtlpSpanSender | None,
        trace_ranks: int,
        device: torch.device,
    ) -> None:
        self.trace_ranks = trace_ranks if sender is not None else 0
        """Ranks a window sends spans from (0: traces are off)."""
        kinds = section_kinds(tuple(phases))
        self.log = SectionLog(kinds) if self.trace_ranks else SectionLog(kinds, capacity=0)
        """The current window's timeline, written by the timers on the training thread."""
        self.attempt = 0
        """The run's attempt this launch trains: 0, or one more than the checkpoint's it resumed from."""
        self._phases = len(phases) + 1  # the declared phases and the data wait
        self._rank, self._world_size, self._exporting = rank, world_size, exporting
        self._run_id = run_id
        self._sender = sender
        self._device = device
        self._wall_offset_s = wall_time() - time.perf_counter()
        self._taken: dict[int, float] = {}
        self._changed = threading.Condition()
        self._queue: collections.deque[TracedWindow] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._dropped = self._failed = 0
        self._anchor_stream: Any = None

    # -- the training thread ---------------------------------------------------------------

    def adopt_run(self, run_id: str) -> None:
        """Windows scheduled from now on are traced as run `run_id`'s."""
        self._run_id = run_id

    def resumed(self, saved_attempt: int) -> None:
        """This launch resumed from a checkpoint of attempt `saved_attempt`: it is the next one."""
        self.attempt = saved_attempt + 1

    def state_taken(self, step: int | None) -> None:
        """`state_dict()` was taken for the checkpoint of `step`: its `train.checkpoint` span starts now."""
        if self.log.keeps and step is not None:
            self._taken[step] = time.perf_counter()
            while len(self._taken) > _CHECKPOINTS_KEPT:
                del self._taken[next(iter(self._taken))]

    def checkpoint_saved(self, step: int) -> None:
        """The checkpoint of `step` is durable: its span ends now."""
        if not self.log.keeps:
            return
        now = time.perf_counter()
        started = self._taken.pop(step, now)
        self._taken = {saved: at for saved, at in self._taken.items() if saved > step}
        self.log.record(self.log.kind(CHECKPOINT_SECTION), started, now)

    def window_sealed(self) -> TracedWindow | None:
        """The timeline of the window being scheduled, with the run and attempt it was trained in."""
        sections = self.log.seal()
        if sections is None:
            return None
        return TracedWindow(sections, self._run_id, self.attempt, self._phases, self._wall_offset_s)

    # -- the publishing thread ---------------------------------------------------------------

    def window_judged(self, sealed: Any, sample: TraceSample) -> Exemplar | None:
        """Send the window's spans if this rank was sampled; on the exporting rank, its exemplar."""
        if not isinstance(sealed, TracedWindow):
            return None
        if self._rank in sample.ranks:
            self._enqueue(sealed)
        return self._exemplar(sealed, sample.slowest) if self._exporting else None

    def _exemplar(self, window: TracedWindow, rank: int) -> Exemplar | None:
        """The exemplar of the window's slowest step (on this rank) on `rank`'s trace of it."""
        timeline = window.sections
        if not timeline.steps:
            return None
        starts = [timeline.since, *timeline.step_ends[:-1]]
        durations = [end - start for start, end in zip(starts, timeline.step_ends, strict=True)]
        slowest = max(range(len(durations)), key=durations.__getitem__)
        trace = trace_id(window.run_id, window.attempt, rank, timeline.steps[slowest])
        return Exemplar(
            value=durations[slowest],
            timestamp=timeline.step_ends[slowest] + window.wall_offset_s,
            trace_id=hex_trace_id(trace),
            span_id=hex_span_id(span_id(trace, STEP_SPAN)),
        )

    def _enqueue(self, window: TracedWindow) -> None:
        with self._changed:
            if self._closed:
                return
            if len(self._queue) >= QUEUED_WINDOWS:
                self._queue.popleft()
                self._dropped += 1
                if self._dropped == 1:
                    logger.warning(
                        "Telemetry: the traces of rank %d fall behind (%d windows waiting to be sent); "
                        "the oldest windows' spans are dropped",
                        self._rank,
                        QUEUED_WINDOWS,
                    )
            self._queue.append(window)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=TRACES_THREAD, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    # -- the traces thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    break
                window = self._queue.popleft()
            try:
                self._send(window)
            except Exception:  # a bad window must not stop the traces of the next ones
                logger.exception("Telemetry: rank %d could not build or send its spans", self._rank)
        if self._sender is not None:
            self._sender.shutdown()

    def _send(self, window: TracedWindow) -> None:
        assert self._sender is not None
        extra = []
        for late in window.sections.late:
            late.wait(LATE_WAIT_S)
            extra.extend(late.sections)
        if window.sections.events:
            anchor = self._anchor()
            extra.extend(
                (kind, anchor.place(start), anchor.place(end)) for kind, start, end in window.sections.events
            )
        spans = window_spans(window, self._rank, extra)
        if self._sender.send(spans, RunInfo(run_id=window.run_id, world_size=self._world_size)):
            return
        self._failed += 1
        if self._failed == 1:
            logger.warning(
                "Telemetry: rank %d's spans of steps %d-%d did not reach %s (later failures are counted, "
                "not logged)",
                self._rank,
                window.sections.steps[0] if window.sections.steps else -1,
                window.sections.steps[-1] if window.sections.steps else -1,
                self._sender.endpoint,
            )

    def _anchor(self) -> HostAnchor:
        """An anchor on this rank's device, to place the sync wait's CUDA events (recorded on an idle
        stream of the traces thread's own)."""
        if self._anchor_stream is None:
            torch.cuda.set_device(self._device)
            self._anchor_stream = torch.cuda.Stream(self._device)
        return HostAnchor(torch.cuda.Event(enable_timing=True), self._anchor_stream)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued (within `timeout_s`), then stop the thread and close the connection."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning(
                    "Telemetry: rank %d's traces were not all sent within %.0f s", self._rank, timeout_s
                )
        if self._failed > 1:
            logger.warning(
                "Telemetry: rank %d's spans of %d windows did not reach the receiver",
                self._rank,
                self._failed,
            )


def checked_attempt(saved: Any) -> int:
    """A checkpoint's attempt (`Telemetry.state_dict()["attempt"]`); raises a `ValueError` naming it."""
    if isinstance(saved, bool) or not (isinstance(saved, int) and saved >= 0):
        raise ValueError(
            f"Telemetry.load_state_dict: attempt must be an integer >= 0, got {saved!r}; "
            "pass the state Telemetry.state_dict() returned"
        )
    return saved


def run_traces(
    config: TelemetryConfig,
    exporters: Sequence[Exporter],
    rank: int,
    world_size: int,
    exporting: bool,
    run_id: str,
    device: torch.device,
) -> RunTraces:
    """This rank's traces, sent to the first `OTelExporter`'s traces endpoint (`config.trace_ranks`:
    None is `DEFAULT_TRACE_RANKS` with an `OTelExporter` and the signals, else 0; more than 0
    without them raises a `ValueError` naming the key)."""
    otel = [exporter for exporter in exporters if isinstance(exporter, OTelExporter)]
    trace_ranks = config.trace_ranks
    if trace_ranks is None:
        trace_ranks = DEFAULT_TRACE_RANKS if otel and config.signals else 0
    elif trace_ranks and not (otel and config.signals):
        raise ValueError(
            f"TelemetryConfig.trace_ranks={trace_ranks}: spans are built from the built-in signals' "
            "timers and sent to an OTelExporter's traces endpoint, and "
            + ("exporters has no OTelExporter" if not otel else "signals=False")
            + "; add tt.OTelExporter() (and keep signals on), or set trace_ranks=0"
        )
    return RunTraces(
        config.phases,
        rank=rank,
        world_size=world_size,
        exporting=exporting,
        run_id=run_id,
        sender=otel[0].span_sender() if trace_ranks else None,
        trace_ranks=trace_ranks,
        device=device,
    )
