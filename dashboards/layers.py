"""The panels of the training dashboard's Layers row (docs/signals.md, Per-layer statistics): the
layers of largest gradient norm over time, norms over every layer, and where a NaN was born. Every
name is read from the signal objects."""

from __future__ import annotations

from typing import Any

from panels import metric, selected, stat, targets, timeseries

TOP_LAYERS = 10
"""Layers drawn per run in the top-norm panels (one line each)."""


def _per_layer(path: str) -> str:
    """A per-layer norm per run and layer (one copy per route)."""
    return f"max by (job, run, layer) ({selected(metric(path))})"


def _over_layers(path: str, stat_name: str) -> str:
    """`stat_name` over the layers' series, or the series the library exports instead above
    `max_layer_series` layers (where the per-layer series are only the largest ones)."""
    wide = f"max by (job, run) ({selected(metric(f'{path}/{stat_name}'))})"
    per_layer = _per_layer(path)
    if stat_name == "median":
        return f"{wide} or quantile by (job, run) (0.5, {per_layer})"
    return f"{wide} or {stat_name} by (job, run) ({per_layer})"


def layer_panels() -> list[dict[str, Any]]:
    """The Layers row's panels: `watch_layers`' norms and where a NaN was born (empty without it)."""
    grad, param = "train/layer/grad_norm", "train/layer/param_norm"
    return [
        timeseries(
            f"Top {TOP_LAYERS} layers by gradient norm",
            "L2 norm of each layer's gradient (telemetry.watch_layers), exact under DDP, FSDP2, HSDP "
            f"and tensor parallelism: the {TOP_LAYERS} largest at each point in time, a line per layer. "
            "A layer whose norm jumps is where the spike comes from; NaN or Inf fires "
            "LayerGradNormNotFinite.",
            "none",
            targets((f"topk({TOP_LAYERS}, {_per_layer(grad)})", "{{run}} {{layer}}")),
        ),
        timeseries(
            f"Top {TOP_LAYERS} layers by parameter norm",
            f"L2 norm of each layer's parameters, the {TOP_LAYERS} largest, a line per layer.",
            "none",
            targets((f"topk({TOP_LAYERS}, {_per_layer(param)})", "{{run}} {{layer}}")),
        ),
        timeseries(
            "Gradient and parameter norm over layers: min / median / max",
            "Over every watched layer (exported as such above max_layer_series layers).",
            "none",
            targets(
                *(
                    (_over_layers(path, stat_name), "{{run}} " + f"{label} {stat_name}")
                    for path, label in ((grad, "gradient"), (param, "parameters"))
                    for stat_name in ("min", "median", "max")
                )
            ),
        ),
        stat(
            "Where a NaN was born: step and rank",
            "The layer that met the run's first NaN or Inf, in its output (forward) or its gradient "
            "(backward): the step, and the lowest rank that met it then (empty until one).",
            "none",
            targets(
                *(
                    (
                        f"max by (job, run, layer) ({selected(metric(f'{name}/{pass_name}'))})",
                        f"{pass_name} {{{{layer}}}} {label}",
                    )
                    for pass_name in ("forward", "backward")
                    for name, label in (
                        ("train/layer/first_nonfinite", "step"),
                        ("train/layer/first_nonfinite_rank", "rank"),
                    )
                )
            ),
            decimals=0,
        ),
    ]
