"""The demo's console: progress bar, banner and summary on rank 0, report lines above the bar."""

from __future__ import annotations

import sys
from typing import Any

import torch

from torchtelemetry.demo._config import DemoConfig

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "ProgressSafeStream",
    "advance",
    "print_banner",
    "print_summary",
    "progress_bar",
]

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C: the run stopped early, flushed everything and exited cleanly."""


class ProgressSafeStream:
    """Console lines written above the progress bar instead of through it."""

    def write(self, text: str) -> int:
        try:
            from tqdm import tqdm
        except ImportError:
            return sys.stderr.write(text)
        tqdm.write(text.rstrip("\n"), file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(config: DemoConfig, *, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=config.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


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


def print_banner(config: DemoConfig, telemetry: Any, world_size: int, device: torch.device) -> None:
    print(f"torchtelemetry demo: run {telemetry.run.run_id}, {world_size} ranks on {device.type}", flush=True)
    for exporter in telemetry.hub.exporters:
        keys = ("url", "path", "log_dir", "tracking_uri")  # where each exporter sends its reports
        where = next(filter(None, (getattr(exporter, key, None) for key in keys)), None)
        if where:
            print(f"  {exporter.name}: {where}", flush=True)
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
