"""What a run prints on its exporting rank: one line at start-up saying where the reports go, and a
short line per window (`TelemetryConfig.window_lines`).

Both are written to `sys.stderr` (of the moment of each write), not logged: they show whatever the
program did with `logging` (nothing, under Python's default configuration, shows below WARNING, and
neither line is a warning), as a progress bar does. `ConsoleExporter` keeps the full line of every
report; a run that has one prints no short lines beside it.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence

from torchtelemetry.export._base import BaseExporter
from torchtelemetry.export._console import ConsoleExporter
from torchtelemetry.export._protocol import Exporter, RunInfo
from torchtelemetry.report import ReportValue, ReportValues

__all__ = [
    "print_startup_line",
    "print_window_line",
    "prints_every_report",
    "startup_line",
    "window_line",
]

PREFIX = "torchtelemetry:"
THROUGHPUT = (("train/tokens_per_second", "tokens/s"), ("train/samples_per_second", "samples/s"))
"""The throughput a short line shows: tokens per second, else samples per second."""


def startup_line(run: RunInfo, every: int, exporters: Sequence[Exporter]) -> str:
    """`torchtelemetry: run <id> (<n> ranks), a report every <every> steps to <name> <where>, ...`."""
    targets = [_target(exporter) for exporter in exporters]
    where = ", ".join(targets) if targets else "no exporter (Telemetry.latest only)"
    ranks = f"{run.world_size} rank{'s' if run.world_size != 1 else ''}"
    return f"{PREFIX} run {run.run_id} ({ranks}), a report every {every} steps to {where}"


def print_startup_line(run: RunInfo, every: int, exporters: Sequence[Exporter]) -> None:
    _print(startup_line(run, every, exporters))


def _print(line: str) -> None:
    """`line` and its newline in one write (lines from two threads never interleave within a line)."""
    stream = sys.stderr
    stream.write(line + "\n")
    stream.flush()


def _target(exporter: Exporter) -> str:
    where = exporter.destination() if isinstance(exporter, BaseExporter) else None
    return f"{exporter.name} {where}" if where else exporter.name


def window_line(step: int, values: ReportValues, window: ReportValues) -> str:
    """`torchtelemetry: step 120 | train/loss 0.4213 | 12.3k tokens/s | ok`: each loss of the
    report (a name ending in `loss`), the throughput and a health word (`_health_word`)."""
    parts = [f"{PREFIX} step {step}"]
    losses = [name for name in _losses(tuple(values)) if isinstance(values[name], float)]
    parts += [f"{name} {values[name]:.4g}" for name in losses]
    for name, unit in THROUGHPUT:
        rate = values.get(name)
        if isinstance(rate, float):
            parts.append(f"{_short(rate)} {unit}")
            break
    parts.append(_health_word(values, window))
    return " | ".join(parts)


def _health_word(values: ReportValues, window: ReportValues) -> str:
    """`ok`, or what the window found: non-finite values, a spike, a straggler (its rank)."""
    found = []
    if _added(window.get("train/nonfinite/count")):
        found.append("non-finite values")
    if _added(window.get("train/spike/count")):
        found.append("spike")
    stragglers = values.get("train/straggler/top_rank")
    if stragglers and isinstance(stragglers, Mapping):
        found.append(f"straggler rank {int(stragglers[min(stragglers)])}")
    return ", ".join(found) or "ok"


# Process-global: a pure function's bounded cache (a report's names -> the losses among them), no run's state.
@functools.lru_cache(maxsize=8)
def _losses(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names of `names` that are losses (the last segment ends in `loss`): a run's reports carry
    the same names window after window, so this is worked out once."""
    return tuple(name for name in names if name.rsplit("/", 1)[-1].endswith("loss"))


def _added(value: ReportValue | None) -> bool:
    counts = value.values() if type(value) is dict or isinstance(value, Mapping) else [value]
    return any(isinstance(count, float) and count > 0 for count in counts)


def _short(value: float) -> str:
    """`12.3k`, `4.56M`: three digits and an SI prefix."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if math.isfinite(value) and abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def print_window_line(step: int, values: ReportValues, window: ReportValues) -> None:
    _print(window_line(step, values, window))


def prints_every_report(exporters: Sequence[Exporter]) -> bool:
    """Whether a `ConsoleExporter` prints the full line of every report already (then no short line)."""
    return any(isinstance(exporter, ConsoleExporter) for exporter in exporters)
