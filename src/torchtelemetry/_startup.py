"""Building a `Telemetry` is collective: every rank learns whether every rank started, within a bound."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

__all__ = ["TelemetryStartupError", "agree_on_start", "require_process_group"]


class TelemetryStartupError(RuntimeError):
    """`Telemetry` did not start on every rank: one rank failed, or not every rank built it in time."""


def require_process_group(op: str) -> None:
    """Raise when the environment launches several processes (`WORLD_SIZE` > 1) without a process group.

    Without one, every process would export its own values as the whole run's, under its own run id.
    """
    if dist.is_available() and dist.is_initialized():
        return
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world_size > 1:
        raise RuntimeError(
            f"{op}: WORLD_SIZE={world_size} in the environment (torchrun or a launcher started "
            f"{world_size} processes) but torch.distributed is not initialized, so each process would "
            "export its own values as if they were the whole run's; call "
            "torch.distributed.init_process_group() before building it"
        )


def agree_on_start(failure: Exception | None, *, timeout_s: float, op: str = "Telemetry") -> None:
    """Share each rank's start-up outcome with every rank; raise on every rank if one failed.

    Collective over the default group, on a gloo group of its own created with `timeout_s`, so a
    rank that never arrives (`if rank == 0: Telemetry(...)`) makes the others raise within
    `timeout_s` and the training's own collectives are never involved. Re-raises `failure` on the
    rank where it happened (with a note naming the rank); the other ranks raise
    `TelemetryStartupError` naming each failed rank and its error. Without a process group it only
    re-raises `failure`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if failure is not None:
            raise failure
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    outcome = None if failure is None else f"{type(failure).__name__}: {failure}"
    outcomes: list[str | None] = [None] * world_size
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        try:
            dist.all_gather_object(outcomes, outcome, group=group)
        finally:
            dist.destroy_process_group(group)
    except Exception as error:
        raise TelemetryStartupError(
            f"{op} (rank {rank} of {world_size}): not every rank built it within timeout_s={timeout_s:g}s "
            f"({type(error).__name__}: {error}); building it is collective: build it on every rank "
            "(only rank 0 exports), or raise timeout_s if some rank starts later"
        ) from (failure if failure is not None else error)
    failed = {index: text for index, text in enumerate(outcomes) if text is not None}
    if failure is not None:
        failure.add_note(f"{op} failed to start on rank {rank} of {world_size}; every rank raised")
        raise failure
    if failed:
        listed = "; ".join(f"rank {index}: {text}" for index, text in failed.items())
        raise TelemetryStartupError(
            f"{op} (rank {rank} of {world_size}): could not start on every rank ({listed}); "
            "every rank stops here instead of training with part of the set-up"
        )
