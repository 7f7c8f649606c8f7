"""The names of the spans a run's traces send and of their attributes (OpenTelemetry spellings), for
the span builder and the signal registry alike (docs/signals.md, "Traces")."""

from __future__ import annotations

from dataclasses import dataclass

from torchtelemetry.report.signals._data_wait import DATA_PHASE
from torchtelemetry.report.signals._hang import COLLECT_PHASE
from torchtelemetry.report.signals._phases import DEFAULT_PHASES
from torchtelemetry.report.signals._timeline import CHECKPOINT_SECTION, SYNC_WAIT_SECTION

__all__ = [
    "ATTEMPT_ATTRIBUTE",
    "PHASE_ATTRIBUTE",
    "RANK_ATTRIBUTE",
    "RUN_ID_ATTRIBUTE",
    "SPAN_ATTRIBUTES",
    "STEP_ATTRIBUTE",
    "STEP_SPAN",
    "SpanName",
    "span_name",
    "span_names",
]

RUN_ID_ATTRIBUTE = "torchtelemetry.run_id"
ATTEMPT_ATTRIBUTE = "torchtelemetry.attempt"
RANK_ATTRIBUTE = "torchtelemetry.rank"
STEP_ATTRIBUTE = "torchtelemetry.step"
PHASE_ATTRIBUTE = "torchtelemetry.phase"
STEP_SPAN = "train.step"

SPAN_ATTRIBUTES = {
    RUN_ID_ATTRIBUTE: "The run id (the `run` label of the run's series), on every span",
    ATTEMPT_ATTRIBUTE: "The attempt of the run: 0 for its first launch, one more for each launch "
    "resumed from a checkpoint, on every span",
    RANK_ATTRIBUTE: "The rank (in the group the windows are reduced over), on every span",
    STEP_ATTRIBUTE: "The training step the span belongs to, on every span",
    PHASE_ATTRIBUTE: "The phase a phase span times (its declared name, or `data`)",
}
"""Every span attribute and what it holds."""


@dataclass(frozen=True, slots=True)
class SpanName:
    """One span a traced step may have."""

    name: str
    description: str
    phase: bool = False
    """Whether it carries `torchtelemetry.phase`."""


def span_name(section: str) -> str:
    """The span of a timed section: `train.<section>` (`train.forward`, `train.data`, ...)."""
    return f"train.{section}"


def span_names(phases: tuple[str, ...] = DEFAULT_PHASES) -> list[SpanName]:
    """The spans of a step traced with `phases` declared (the registry lists the default ones)."""
    return [
        SpanName(
            STEP_SPAN,
            "One training step, from the previous `step()` to its own: the root of the step's trace",
        ),
        *(
            SpanName(span_name(phase), f"Phase {phase!r} (`Telemetry.phase`), each time entered", True)
            for phase in phases
        ),
        SpanName(span_name(DATA_PHASE), "The wait for the step's batch (`Telemetry.data_wait`)", True),
        SpanName(
            span_name(SYNC_WAIT_SECTION),
            "A backward's wait for the gradient collective (`Telemetry.watch_gradient_sync`)",
        ),
        SpanName(
            span_name(COLLECT_PHASE), "A wait for a window's collection (`max_pending` reached, `flush`)"
        ),
        SpanName(
            span_name(CHECKPOINT_SECTION),
            "From `Telemetry.state_dict()` for a step to `checkpoint_saved(step)`",
        ),
    ]
