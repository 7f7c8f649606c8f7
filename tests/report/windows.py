"""Collect one window of a `SignalSet` without a `Telemetry`: flush, reduce over the process group
(one real collective per bucket when there is one), compute, flatten and derive, as a window does."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.metric import metric_leaves, sync_metrics
from torchtelemetry.report import flatten_results, to_python
from torchtelemetry.report.signals import SignalContext, SignalSet, WindowTiming


def context(world_size: int = 1, rank: int = 0, max_rank_series: int = 64) -> SignalContext:
    return SignalContext(
        world_size=world_size, rank=rank, device=torch.device("cpu"), max_rank_series=max_rank_series
    )


def collect_window(
    signals: SignalSet, *, step: int = 0, steps: int = 1, duration_s: float = 1.0, final: bool = True
) -> dict[str, Any]:
    """The report values the signals derive from one window ending at `step`."""
    signals.flush(duration_s, final=final)
    tree = signals.metrics()
    leaves = metric_leaves(tree, op="collect_window")
    if dist.is_initialized() and dist.get_world_size() > 1:
        sync_metrics(tree)
    window = flatten_results(leaves, [to_python(metric.compute()) for _, metric in leaves])
    timing = WindowTiming(
        step=step, timestamp=time.time(), duration_s=duration_s, steps=steps, host=signals.host_values()
    )
    signals.derive(window, timing)
    for _, metric in leaves:
        metric.reset()
    return window
