"""`SignalSet`: the signals of one `Telemetry`, and the routing of steps, phases and windows to them."""

from __future__ import annotations

import collections
import types
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from torchtelemetry.metric import Metric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, WindowTiming
from torchtelemetry.report.signals._clock import HostTimer, PhaseTimer
from torchtelemetry.report.signals._data_wait import DATA_PHASE, DataWait
from torchtelemetry.report.signals._layer_state import LayerWatch
from torchtelemetry.report.signals._layers import LayerStatistics
from torchtelemetry.report.signals._phases import Phases
from torchtelemetry.report.signals._sync_wait import SyncWait
from torchtelemetry.report.signals._trace_sampling import TraceSampling

__all__ = ["SignalSet"]

SignalT = TypeVar("SignalT", bound=Signal)


class SignalSet:
    """Routes `Telemetry.step()` keywords and windows to signals, and `phase()`, `data_wait()`,
    `watch_gradient_sync()` and `watch_layers()` to the one signal that has each (found by its
    class: a class's `name` is fixed, so there is at most one of it).

    Signals derive in the order given: one that reads another's raw values (throughput reads the
    token count) comes after it. Names, keywords and metric paths must not repeat.
    """

    def __init__(self, signals: Sequence[Signal]) -> None:
        self.signals = tuple(signals)
        names = collections.Counter(signal.name for signal in self.signals)
        keywords = collections.Counter(keyword for signal in self.signals for keyword in signal.keywords)
        repeated = sorted(
            name for counted in (names, keywords) for name, count in counted.items() if count > 1
        )
        if repeated:
            raise ValueError(f"SignalSet: signal names or step keywords {repeated} are used twice")
        self._by_keyword = {keyword: signal for signal in self.signals for keyword in signal.keywords}
        self._timers: dict[str, PhaseTimer | HostTimer] = {
            name: timer
            for signal in self.signals
            if isinstance(signal, DataWait | Phases)  # the data wait's phase is refused as a phase name
            for name, timer in signal.timers().items()
        }
        self.timers: Mapping[str, PhaseTimer | HostTimer] = types.MappingProxyType(self._timers)
        """The timer of every declared phase and of the data wait ("data"), by name (read-only)."""
        self._flush_order = sorted(self.signals, key=lambda signal: signal.flush_reads_state)
        self._on_step = [
            signal.on_step for signal in self.signals if type(signal).on_step is not Signal.on_step
        ]
        """The `on_step` of the signals that take note of every step (the others' does nothing)."""

    def _find(self, kind: type[SignalT]) -> SignalT | None:
        """The signal of class `kind`, None when it is off."""
        return next((signal for signal in self.signals if isinstance(signal, kind)), None)

    @property
    def keywords(self) -> frozenset[str]:
        return frozenset(self._by_keyword)

    def metrics(self) -> dict[str, Metric]:
        """Every signal's window state, by metric path."""
        found: dict[str, Metric] = {}
        for signal in self.signals:
            for path, metric in signal.metrics().items():
                if path in found:
                    raise ValueError(f"SignalSet: metric path {path!r} is used by two signals")
                found[path] = metric
        return found

    def descriptors(self) -> list[MetricDescriptor]:
        return [descriptor for signal in self.signals for descriptor in signal.descriptors()]

    # -- training thread --------------------------------------------------------------------

    def record_step(self, step: int, step_time: float | None, inputs: Mapping[str, Any]) -> None:
        """One step ended with `inputs` (keyword -> value, None for not given): every value is
        checked before any is recorded, so a bad one leaves the step unrecorded."""
        by_keyword = self._by_keyword
        routed: list[tuple[str, Any, Signal]] = []  # a loop: a comprehension is a function call (3.11)
        for keyword, value in inputs.items():
            if value is not None:
                signal = by_keyword.get(keyword)
                if signal is None:
                    unknown = sorted(
                        key for key, given in inputs.items() if given is not None and key not in by_keyword
                    )
                    raise TypeError(
                        f"Telemetry.step: no signal takes {unknown} (signals take {sorted(by_keyword)})"
                    )
                routed.append((keyword, value, signal))
        for keyword, value, signal in routed:
            signal.check(keyword, value)
        for keyword, value, signal in routed:
            signal.record(keyword, value)
        for on_step in self._on_step:
            on_step(step, step_time)

    def data_wait_timer(self) -> PhaseTimer | HostTimer:
        """The timer of the data wait (the phase "data")."""
        if DATA_PHASE not in self._timers:
            raise ValueError("Telemetry.data_wait: no data wait signal in this SignalSet")
        return self._timers[DATA_PHASE]

    def phase(self, name: str) -> PhaseTimer | HostTimer:
        """The timer of phase `name` (`TelemetryConfig.phases`, or "data": the data wait)."""
        if name not in self._timers:
            raise self._undeclared("Telemetry.phase", name)
        return self._timers[name]

    def _undeclared(self, op: str, name: str) -> ValueError:
        declared = tuple(phase for phase in self._timers if phase != DATA_PHASE)
        if not declared:
            return ValueError(f"{op}: no phases are timed (phase {name!r}); set TelemetryConfig.phases")
        return ValueError(
            f"{op}: {name!r} is not a declared phase (TelemetryConfig.phases = {declared}); add it "
            "there: every rank must know its phases before the first collection, as their times ride "
            "the window's collective"
        )

    @property
    def section_timers(self) -> tuple[PhaseTimer | HostTimer, ...]:
        """The timer of every phase and of the data wait: where the hang heartbeat reads which
        sections the training thread is inside."""
        return tuple(self._timers.values())

    def watch_gradient_sync(self, model: Any, phase: str) -> None:
        """Time the wait for `model`'s gradient collective (the sync wait signal), held by phase
        `phase`: the phases' straggler scores and the trace sampling take that wait out of it."""
        if phase == DATA_PHASE or phase not in self._timers:
            raise self._undeclared("Telemetry.watch_gradient_sync", phase)
        wait = self._find(SyncWait)
        if wait is None:
            raise ValueError(
                f"Telemetry.watch_gradient_sync: the sync wait signal ({SyncWait.name!r}) is not in "
                "this SignalSet"
            )
        wait.watch_gradient_sync(model)
        for signal in self.signals:
            if isinstance(signal, Phases | TraceSampling):
                signal.set_sync_phase(phase)

    def watch_layers(self, model: Any, watch: LayerWatch) -> None:
        """Watch `model`'s layers (`Telemetry.watch_layers`): the layer statistics signal."""
        layers = self._find(LayerStatistics)
        if layers is None:
            raise ValueError(
                f"Telemetry.watch_layers: the layer statistics signal ({LayerStatistics.name!r}) is not in "
                "this SignalSet"
            )
        layers.watch_layers(model, watch)

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        """Every signal hands its host values to the window's state: staged by the state's collector
        and applied with the step's updates (one host row, one copy); the signals whose flush reads the
        state go last, so that it is applied once."""
        for signal in self._flush_order:
            signal.flush(duration_s, final=final)

    def host_values(self) -> dict[str, Any]:
        """What each signal's `derive` reads from `WindowTiming.host`, taken now."""
        values = {}
        for signal in self.signals:
            value = signal.host_values()
            if value is not None:
                values[signal.name] = value
        return values

    # -- the thread that publishes ------------------------------------------------------------

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        for signal in self.signals:
            signal.derive(window, timing)

    # -- checkpoints and close ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {signal.name: state for signal in self.signals if (state := signal.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for signal in self.signals:
            signal.load_state_dict(state.get(signal.name, {}))

    def close(self) -> None:
        for signal in self.signals:
            signal.close()
