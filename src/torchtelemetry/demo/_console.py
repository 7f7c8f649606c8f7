"""The demo's console: progress bar, banner and summary on rank 0; lines written to stderr while the
bar is shown (the window lines `Telemetry` prints, warnings) go above it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from torchtelemetry.demo._config import DemoConfig

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "above_the_bar",
    "advance",
    "print_banner",
    "print_summary",
    "progress_bar",
]

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C: the run stopped early, flushed everything and exited cleanly."""


class _AboveTheBar:
    """A stream whose lines tqdm writes above its bars, on `stream` (each write ends with its newline:
    `Telemetry`'s lines, logging's and warnings' do)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        tqdm.write(text.rstrip("\n"), file=self._stream)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


def progress_bar(config: DemoConfig, *, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=config.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


@contextlib.contextmanager
def above_the_bar(progress: Any) -> Iterator[None]:
    """While the bar `progress` is shown, what is written to `sys.stderr` goes above it; the bar is
    closed at the end."""
    if progress is None:
        yield
        return
    try:
        with contextlib.redirect_stderr(_AboveTheBar(sys.stderr)):
            yield
    finally:
        progress.close()


def advance(progress: Any, telemetry: Any) -> None:
    if progress is None:
        return
    progress.update(1)
    latest = telemetry.latest
    if "train/loss" in latest:
        progress.set_postfix(
            loss=f"{latest['train/loss']:.3f}",
            tok_s=f"{latest.get('train/tokens_per_second', float('nan')):.0f}",
            refresh=False,
        )


def print_banner(
    config: DemoConfig, telemetry: Any, world_size: int, device: torch.device, checkpoints: Path
) -> None:
    """What the run is; where its reports go is the line `Telemetry` printed at start-up."""
    print(f"torchtelemetry demo: run {telemetry.run.run_id}, {world_size} ranks on {device.type}", flush=True)
    if config.checkpoint_every is not None:
        print(f"  checkpoint every {config.checkpoint_every} steps: {checkpoints}", flush=True)
    print("  full stack (Prometheus, Grafana, Collector, Pushgateway): docker compose up -d", flush=True)


def print_summary(telemetry: Any, last_step: int, status: int) -> None:
    state = "interrupted" if status == INTERRUPTED_EXIT_CODE else "finished"
    print(f"\n{state} after step {last_step}; final window:", flush=True)
    width = max((len(name) for name in telemetry.latest), default=10)
    for name, value in sorted(telemetry.latest.items()):
        if isinstance(value, float):
            text = f"{value:.6g}"
        elif isinstance(value, dict):
            text = ", ".join(f"{label}={v:.4g}" for label, v in value.items())
        else:
            text = f"histogram: count={value.count:.0f}, sum={value.sum:.4g}"
        print(f"  {name:<{width}}  {text}", flush=True)
    for name, health in telemetry.hub.health().items():
        print(
            f"  exporter {name}: {health.exported_reports} reports, {health.errors} errors, "
            f"{health.dropped_reports} dropped",
            flush=True,
        )
