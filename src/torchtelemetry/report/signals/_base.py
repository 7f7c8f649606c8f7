"""The signal protocol: each built-in training signal is one small object.

A signal is a subclass of `Signal` that overrides what it needs of its 17 members (5 declarations,
12 hooks with do-nothing defaults). Each is either part of a window's life (declare, take a step,
hand a window over, derive it) or something several signals do; a concern of the model or of the
whole run (`Telemetry.phase()`, `watch_gradient_sync()`, `watch_layers()`) reaches the one signal
that has it directly through `SignalSet`, and what lasts for the run is `torchtelemetry.run`'s.

- `name`: the key of its host values and state (they ride windows and checkpoints by name).
- `keywords`: the `Telemetry.step()` keywords it takes, so that `SignalSet` routes them to it.
- `sample_inputs()`: a value `check()` accepts for each keyword, as a training step gives it (the
  tests' training loops feed every signal's samples).
- `event_names`: the names it exports only once something went wrong (a non-finite value, a
  straggler, a capture): a healthy run has none, and the live dashboards' checks allow them empty.
- `flush_reads_state`: its `flush` reads the window's state: flushed after the others, so that
  their staged host values are applied once (the non-finite sentinel).
- `metrics()`, at set-up: its window state, reduced with the user's metrics in the one collective.
- `descriptors()`, at set-up: every name `derive` may export (the hub, the registry and the
  dashboards know them before the first window).
- `cuda_descriptors()`, with no instance: the names it exports on CUDA only, so that a CPU machine
  still lists them (memory, peak memory, GPU health).
- `check(keyword, value)`, training thread, each step: refuse bad input before anything of the step
  is recorded (a step is recorded whole or not at all).
- `record(keyword, value)`, training thread, after every keyword was checked: take the value.
- `on_step(step, step_time)`, training thread, at each step's end: counts and per-step device work
  (`SignalSet` calls only the signals that override it).
- `flush(duration_s, final=)`, training thread, once per window, before a checkpoint and at close:
  hand host accumulators to the window's state (in-place device ops, never a sync).
- `host_values()`, training thread, as a window is scheduled: host facts its `derive` needs.
- `derive(window, timing)`, publishing thread, window after window: raw values to exported names.
  A counter's window value is the window's increment (the publisher keeps the running total).
- `state_dict()` / `load_state_dict()`, training thread: what it carries over a restart.
- `close()`: stop its threads and remove its hooks; the last window has been flushed.

Adding a signal: docs/signals.md, "Adding a signal".
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from torchtelemetry.metric import DEFAULT_STATE_DTYPE, Metric, MetricAccumulator, ReduceOp
from torchtelemetry.report._values import MetricDescriptor, ReportValue

__all__ = [
    "RankValues",
    "Signal",
    "SignalContext",
    "WindowTiming",
    "by_index",
    "finite_by_rank",
    "highest_rank",
    "lowest_rank",
    "median",
    "median_rank",
]


@dataclass(frozen=True, slots=True)
class WindowTiming:
    """Host facts of one collection window, taken on the training thread when it was scheduled."""

    step: int
    """Last training step in the window."""
    timestamp: float
    """Unix time at which the window was scheduled."""
    duration_s: float
    """Host time from the previous window's schedule to this one's."""
    steps: int = 0
    """Training steps in the window (the same on every rank)."""
    host: Mapping[str, Any] = field(default_factory=dict)
    """Host-only values of the signals at schedule time (`Signal.host_values`), by signal name."""


@dataclass(frozen=True, slots=True)
class SignalContext:
    """Where the signals of one `Telemetry` run."""

    world_size: int
    """Ranks of the group the window is reduced over."""
    rank: int
    """This process's rank in that group."""
    device: torch.device
    """Device of the metrics (and of the training)."""
    max_rank_series: int = 64
    """Above this many ranks, no value is exported once per rank."""

    @property
    def per_rank_series(self) -> bool:
        """Whether values per rank are exported as one series per rank."""
        return self.world_size <= self.max_rank_series


class Signal:
    """Base class of a built-in signal; every hook has a do-nothing default (the module lists them).

    Threads: `record`, `on_step`, `flush`, `host_values`, `state_dict` and `load_state_dict` run on
    the training thread; `derive` on the thread that publishes reports, one window at a time, in
    order. State that `derive` keeps across windows is the signal's to guard.
    """

    name: str = ""
    """Short name, the key of this signal's `host_values` and state."""
    keywords: tuple[str, ...] = ()
    """`Telemetry.step()` keywords this signal takes."""
    flush_reads_state: ClassVar[bool] = False
    """Whether `flush` reads the window's state (derives a state from another): such a signal is
    flushed after every other, so that the host values they staged are applied in one go."""
    event_names: ClassVar[frozenset[str]] = frozenset()
    """The names of `descriptors()` exported only once something happened in the run (a non-finite
    value, a rank that straggles, a capture): a healthy run has none, and the dashboards' panels of
    them stay empty (`event_only_descriptors()`)."""

    def __init__(self, context: SignalContext) -> None:
        self.context = context

    def metrics(self) -> dict[str, Metric]:
        """The device state of a window, by metric path; reduced with the user's metrics."""
        return {}

    def descriptors(self) -> list[MetricDescriptor]:
        """Every name `derive` may leave in a report."""
        return []

    @staticmethod
    def cuda_descriptors() -> list[MetricDescriptor]:
        """The names this signal exports only when training on CUDA (the registry, the dashboards and
        the alert rules know them on any machine)."""
        return []

    def check(self, keyword: str, value: Any) -> None:
        """Raise, naming the signal, if `value` given as `keyword` cannot be recorded. Runs for every
        keyword of a step before anything of the step is recorded."""

    def record(self, keyword: str, value: Any) -> None:
        """Take a checked value of one step (host arithmetic, or in-place device ops: never a sync)."""

    def sample_inputs(self) -> dict[str, Any]:
        """A value `check` accepts for each of `keywords`, as a training step would give it: what the
        tests' training loops feed `Telemetry.step()`, so a new keyword reaches every loop that feeds
        them all without being named there (as a metric's `examples()` reach the metric suites)."""
        return {}

    def on_step(self, step: int, step_time: float | None) -> None:
        """Step `step` ended; `step_time` is the host time since the previous one (None for the first)."""

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        """Hand host accumulators to `metrics()` (in-place device ops, no sync); `duration_s` is this
        rank's host time since the previous flush. Runs once per window, and before a checkpoint and
        at close (`final`: wait, bounded, for values still being measured, e.g. device timings)."""

    def host_values(self) -> Any:
        """Host-only values that `derive` reads from `WindowTiming.host[name]` (exporting rank's)."""
        return None

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        """Turn the window's values (all signals' raw values and the user's) into what is exported,
        in place."""

    def state_dict(self) -> dict[str, Any]:
        """What this signal carries over a restart (plain Python values)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`."""

    def close(self) -> None:
        """Stop threads this signal started; the last window has been flushed."""


class RankValues(Metric):
    """One value per rank and quantity, each rank writing its own slot: a `(quantities, world_size)`
    state reduced by MAX (or MIN) that rides the window like any metric, with no extra collective.

    Within a window a slot keeps the largest (MAX) or smallest (MIN) value written to it; slots
    nobody wrote stay at -inf (+inf) and are left out by `finite_by_rank`.
    """

    label_name = "rank"
    keyed_states: ClassVar[Mapping[str, str]] = {"values": "quantities"}

    def __init__(
        self, world_size: int, rank: int, quantities: Sequence[str], *, op: ReduceOp = ReduceOp.MAX
    ) -> None:
        super().__init__()
        self.rank = rank
        self.quantities = tuple(quantities)
        self.op = op
        start = -math.inf if op is ReduceOp.MAX else math.inf
        self.values = MetricAccumulator(
            torch.full((len(self.quantities), world_size), start), op, dtype=DEFAULT_STATE_DTYPE
        )

    def write(self, index: int, value: float) -> None:
        """Fold host `value` into this rank's slot of quantity `index` (staged with the window's other
        host values when bound: no op of its own)."""
        self.values.update_at((index, self.rank), value)

    def configuration(self) -> dict[str, Any]:
        """The quantities: ranks must hold the same ones, in the same order."""
        return {**super().configuration(), "quantities": list(self.quantities)}

    def compute(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.quantities, self.values.value.unbind(0), strict=True))  # one op, not one each


def by_index(values: ReportValue | None) -> dict[int, float]:
    """A 1-D state's values as exported (`{"0": 1.5, ...}`), keyed by integer index."""
    if values is None or (type(values) is not dict and not isinstance(values, Mapping)):  # ABC check last
        return {}
    return {int(index): float(value) for index, value in values.items()}


def finite_by_rank(values: ReportValue | None) -> dict[int, float]:
    """The finite entries of a value per rank (`{"0": 1.5, ...}`), keyed by integer rank."""
    if values is None or (type(values) is not dict and not isinstance(values, Mapping)):
        return {}
    return {int(rank): float(value) for rank, value in values.items() if math.isfinite(value)}


def highest_rank(values: Mapping[int, float]) -> int:
    """The rank holding the largest value (the lowest such rank on ties)."""
    return -max(zip(values.values(), map(operator.neg, values), strict=True))[1]


def lowest_rank(values: Mapping[int, float]) -> int:
    """The rank holding the smallest value (the lowest such rank on ties)."""
    return min(zip(values.values(), values, strict=True))[1]


def median(values: Mapping[int, float]) -> float:
    return statistics.median(values.values())


def median_rank(values: Mapping[int, float]) -> int:
    """The rank holding the lower median value (ordered by value, then rank): of two ranks, the
    one with the smaller value."""
    ordered = sorted(zip(values.values(), values, strict=True))
    return ordered[(len(ordered) - 1) // 2][1]
