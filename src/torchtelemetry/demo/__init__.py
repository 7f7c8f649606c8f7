"""`torchtelemetry demo`: a real multi-process training run wired to every exporter.

Trains a tiny transformer language model on synthetic token data with
DistributedDataParallel (gloo on CPU, NCCL on GPUs). Spawns `--nproc` ranks
itself, or runs unchanged under `torchrun` (`python -m torchtelemetry.demo`).

One file per job: `_config` (`DemoConfig`), `_cli` (the command line generated from it),
`_model` (model, data, one training step with its phases, the metrics), `_exporters` (what the
flags turn on), `_checkpoint` (model, optimizer and telemetry state, marked durable for goodput),
`_loop` (one rank's training loop), `_console` (progress and summary), `_launcher` (spawning
ranks, Ctrl-C).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtelemetry.demo._cli import build_parser, parse_args
from torchtelemetry.demo._config import DemoConfig
from torchtelemetry.demo._launcher import run
from torchtelemetry.demo._model import (
    StepResult,
    TinyLM,
    build_metrics,
    learning_rate_at,
    synthetic_batch,
    train_step,
    update_metrics,
)

__all__ = [
    "DemoConfig",
    "StepResult",
    "TinyLM",
    "build_metrics",
    "build_parser",
    "learning_rate_at",
    "main",
    "parse_args",
    "run",
    "synthetic_batch",
    "train_step",
    "update_metrics",
]


def main(argv: Sequence[str] | None = None) -> int:
    """`torchtelemetry demo [flags]`: parse the flags and run; returns the exit status."""
    return run(parse_args(argv))
