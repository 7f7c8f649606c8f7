"""Per-layer statistics (`Telemetry.watch_layers`): each layer's gradient and parameter norms, exact
under any sharding, and the layer, pass, step and rank where a NaN was born.

The norms are measured on the device at the step that ends each window (or every `every` steps,
reported in the window that holds the step): at the first `optimizer.step()` of that step that
steps a watched parameter, before it changes anything (the gradient it applies: after DDP's
all-reduce, FSDP's reduce-scatter and any clipping), else at `Telemetry.step()`. Each rank adds its
local sums of squares divided by their copies (`_layer_model`) into the window's SUM; the square
root comes after the reduction. A window holds the latest measurement of its steps.

Every step, each watched layer's output and gradients are checked on the device; the first step
each layer saw a non-finite value rides the window as `step * 2**20 + rank`, reduced by MIN (the
earliest step, then the lowest rank; exact in float64 up to step 2**33, at any world size). Per
pass, the layer where a NaN was born is the one that saw it first: at the earliest step, then the
first in the order the pass reaches the layers.

Above `max_layer_series` layers, only the `max_layer_series` layers of largest gradient norm (the
non-finite ones first) are exported one series per layer, with min / median / max over layers.
Everything is kept by layer name: the names ride the window's layout and the checkpoint. The window's
state, the names and `LayerWatch` are `_layer_state`'s; the model side is `_layer_model`'s.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.metric import Metric
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import Signal, SignalContext, WindowTiming, by_index
from torchtelemetry.report.signals._layer_model import Measurement, WatchedLayers
from torchtelemetry.report.signals._layer_state import (
    FIRST_NONFINITE,
    FIRST_NONFINITE_RANK,
    GRAD_NORM,
    LAYER_STATS,
    PARAM_NORM,
    PASSES,
    RANK_CODES,
    STATE,
    LayerState,
    LayerWatch,
)
from torchtelemetry.sync import GroupLike, resolve_group

__all__ = ["DEFAULT_MAX_LAYER_SERIES", "LayerStatistics"]

DEFAULT_MAX_LAYER_SERIES = 64
"""`TelemetryConfig.max_layer_series` by default."""
OVER_LAYERS = ("min", "median", "max")


@dataclass(frozen=True, slots=True)
class LayerWindow:
    """What the exporting rank knew of its layers when a window was scheduled."""

    names: tuple[str, ...]
    stats: tuple[str, ...]
    measurement: Measurement | None
    """The window's latest measurement of the norms (None: no step of the window measured them)."""
    order: dict[str, dict[str, int]]
    """Per pass, layer name -> place in the order the pass first reached it."""


class LayerStatistics(Signal):
    """Per-layer norms and where a NaN was born, once `watch_layers()` was called (see the module)."""

    name = "layers"
    event_names = frozenset(
        f"{path}/{name}" for path in (FIRST_NONFINITE, FIRST_NONFINITE_RANK) for name in PASSES
    )

    def __init__(
        self,
        context: SignalContext,
        *,
        every: int = 10,
        max_layer_series: int = DEFAULT_MAX_LAYER_SERIES,
    ) -> None:
        super().__init__(context)
        self.state = LayerState().to(context.device)
        self._window_every = every
        self._max_series = max_layer_series
        self._layers: WatchedLayers | None = None
        self._stats: tuple[str, ...] = ()
        self._every = every
        self._steps = 0
        """Steps ended since the run started (the step in progress is the next one)."""
        self._measured_step = 0
        self._measurement: Measurement | None = None
        self._optimizer_hook: Any = None
        self._first: dict[str, dict[str, tuple[int, int]]] = {name: {} for name in PASSES}
        self._lock = threading.Lock()

    def metrics(self) -> dict[str, Metric]:
        return {STATE: self.state}

    def descriptors(self) -> list[MetricDescriptor]:
        described = [
            MetricDescriptor(GRAD_NORM, description="L2 norm of the layer's gradient", label_name="layer"),
            MetricDescriptor(PARAM_NORM, description="L2 norm of the layer's parameters", label_name="layer"),
        ]
        for path in LAYER_STATS.values():
            described += [
                MetricDescriptor(f"{path}/{stat}", description=f"{stat} over layers") for stat in OVER_LAYERS
            ]
        for name in PASSES:
            described += [
                MetricDescriptor(
                    f"{FIRST_NONFINITE}/{name}",
                    description=f"Step at which the {name} pass first met a non-finite value, in this layer",
                    label_name="layer",
                ),
                MetricDescriptor(
                    f"{FIRST_NONFINITE_RANK}/{name}",
                    description=f"Lowest rank whose {name} pass met that first non-finite value",
                    label_name="layer",
                ),
            ]
        return described

    def watch_layers(self, model: torch.nn.Module, watch: LayerWatch) -> None:
        """Hook `model`'s layers and the optimizers' steps as `watch` says (`Telemetry.watch_layers`)."""
        if self._layers is not None:
            raise RuntimeError("Telemetry.watch_layers: layers are watched already; call it once")
        group_ranks = _group_ranks(watch.group)
        watched = WatchedLayers(
            model,
            watch.layers,
            device=self.context.device,
            group_ranks=group_ranks,
            nonfinite=watch.nonfinite,
        )
        self.state.resize(watched.names, self.context.device)
        self._layers, self._stats = watched, tuple(dict.fromkeys(watch.stats))
        self._every = watch.every or self._window_every
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._optimizer_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    # -- training thread ---------------------------------------------------------------------

    def _due(self) -> bool:
        step = self._steps + 1
        return step % self._every == 0 and self._measured_step != step

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._layers is not None and self._due() and self._layers.holds_any(optimizer):
            self._measure()

    def _measure(self) -> None:
        assert self._layers is not None
        self._measured_step = self._steps + 1
        self._measurement = self._layers.measure(
            self.state.grad_sumsq.local if "grad_norm" in self._stats else None,
            self.state.param_sumsq.local if "param_norm" in self._stats else None,
        )

    def on_step(self, step: int, step_time: float | None) -> None:
        if self._layers is not None:
            if self._due():
                self._measure()
            if self._layers.checks is not None:
                self._layers.checks.fold(float(step * RANK_CODES + self.context.rank), self.state.first.local)
        self._steps += 1

    def host_values(self) -> LayerWindow | None:
        if self._layers is None:
            return None
        measurement, self._measurement = self._measurement, None
        names = self._layers.names
        checks = self._layers.checks
        orders = (checks.forward_order, checks.backward_order) if checks is not None else ({}, {})
        order = {
            name: {names[index]: place for index, place in found.items()}
            for name, found in zip(PASSES, orders, strict=True)
        }
        return LayerWindow(tuple(names), self._stats, measurement, order)

    # -- the thread that publishes -------------------------------------------------------------

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        raw = {key: by_index(window.pop(f"{STATE}/{key}", None)) for key in _RAW}
        layers = timing.host.get(self.name)
        if not isinstance(layers, LayerWindow):
            return
        if layers.measurement is not None:
            self._export_norms(window, layers, raw)
        with self._lock:
            for name in PASSES:
                seen = self._first[name]
                for index, code in raw[f"first_{name}"].items():
                    if math.isfinite(code) and layers.names[index] not in seen:
                        seen[layers.names[index]] = divmod(int(code), RANK_CODES)
                watched = {layer: first for layer, first in seen.items() if layer in layers.names}
                if not watched:
                    continue
                order = layers.order[name]
                born = min(watched, key=lambda layer: (watched[layer][0], order.get(layer, math.inf), layer))
                step, rank = watched[born]
                window[f"{FIRST_NONFINITE}/{name}"] = {born: float(step)}
                window[f"{FIRST_NONFINITE_RANK}/{name}"] = {born: float(rank)}

    def _export_norms(
        self, window: dict[str, ReportValue], layers: LayerWindow, raw: dict[str, dict]
    ) -> None:
        measurement = layers.measurement
        assert measurement is not None
        norms: dict[str, dict[str, float]] = {}
        for stat in layers.stats:
            left_out = measurement.partial | (
                measurement.without_gradient if stat == "grad_norm" else frozenset()
            )
            sums = raw["grad_sumsq" if stat == "grad_norm" else "param_sumsq"]
            norms[stat] = {
                name: math.sqrt(sums.get(index, 0.0))
                for index, name in enumerate(layers.names)
                if name in measurement.layers and name not in left_out
            }
        norms = {stat: values for stat, values in norms.items() if values}
        if len(layers.names) <= self._max_series:
            for stat, values in norms.items():
                window[LAYER_STATS[stat]] = values
            return
        ranking = norms.get("grad_norm") or norms.get("param_norm") or {}
        top = sorted(ranking, key=lambda name: _largest_first(ranking[name]))[: self._max_series]
        for stat, values in norms.items():
            window[LAYER_STATS[stat]] = {name: values[name] for name in top if name in values}
            window.update(_over_layers(LAYER_STATS[stat], list(values.values())))

    # -- checkpoints and close -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The first non-finite value of each layer and pass, the steps counted (when the norms are
        measured next) and the current window's measurement (its sums ride the window's state)."""
        with self._lock:
            first = {
                name: {layer: list(value) for layer, value in seen.items()}
                for name, seen in self._first.items()
            }
        measured = self._measurement
        return {
            "first": first,
            "steps": self._steps,
            "measurement": None
            if measured is None
            else {
                "layers": sorted(measured.layers),
                "without_gradient": sorted(measured.without_gradient),
                "partial": sorted(measured.partial),
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._steps = int(state.get("steps", self._steps))
        measured = state.get("measurement")
        self._measurement = (
            None
            if measured is None
            else Measurement(
                frozenset(measured["layers"]),
                frozenset(measured["without_gradient"]),
                frozenset(measured["partial"]),
            )
        )
        saved = state.get("first", {})
        with self._lock:
            self._first = {
                name: {layer: (int(step), int(rank)) for layer, (step, rank) in saved.get(name, {}).items()}
                for name in PASSES
            }

    def close(self) -> None:
        """Take every hook out of the model and the optimizers."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self._layers is not None:
            self._layers.close()


_RAW = ("grad_sumsq", "param_sumsq", *(f"first_{name}" for name in PASSES))


def _group_ranks(group: GroupLike) -> list[int]:
    resolved = resolve_group(group, op="Telemetry.watch_layers")
    return [0] if resolved is None else dist.get_process_group_ranks(resolved)


def _largest_first(value: float) -> tuple[int, float]:
    """Sort key: non-finite values first, then the largest."""
    return (0, 0.0) if not math.isfinite(value) else (1, -value)


def _over_layers(path: str, values: list[float]) -> dict[str, float]:
    """min / median / max over layers: NaN left out of min and median (+-Inf ordered), and the max NaN
    when any layer's is (so that a NaN shows even when its layer's own series is not exported)."""
    ordered = sorted(value for value in values if not math.isnan(value))
    if not ordered:
        return {f"{path}/{stat}": math.nan for stat in OVER_LAYERS}
    return {
        f"{path}/min": ordered[0],
        f"{path}/median": statistics.median(ordered),
        f"{path}/max": math.nan if len(ordered) < len(values) else ordered[-1],
    }
