"""The demo's checkpoint: the model, the optimizer and `Telemetry.state_dict()`, marked durable for
goodput (`Telemetry.checkpoint_saved`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.demo._config import run_directory

__all__ = ["CHECKPOINT_FILE", "checkpoint_directory", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.pt"
"""The one file in the checkpoint directory: each checkpoint replaces the previous one."""


def checkpoint_directory(run_id: str) -> Path:
    """Where the demo's checkpoint of run `run_id` goes: `runs/<run_id>/checkpoint`."""
    return run_directory(run_id) / "checkpoint"


def save_checkpoint(
    directory: Path, step: int, model: torch.nn.Module, optimizer: Any, telemetry: Any
) -> None:
    """Checkpoint step `step`, on every rank at once (`Telemetry.state_dict()` is collective and loads
    at any world size): rank 0 writes `directory/checkpoint.pt` (a new file, 0600, renamed over the
    previous one once synced), then every rank marks it durable."""
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "telemetry": telemetry.state_dict(),
    }
    if dist.get_rank() == 0:
        _write(directory, state)
    dist.barrier()  # written and synced before any rank says it is durable
    telemetry.checkpoint_saved(step)


def _write(directory: Path, state: dict[str, Any]) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = directory / f"{CHECKPOINT_FILE}.{os.getpid()}.partial"
    partial.unlink(missing_ok=True)  # left by a run of this process id that was killed while writing
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, directory / CHECKPOINT_FILE)
