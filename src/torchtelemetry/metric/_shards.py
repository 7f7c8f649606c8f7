"""Local metric states in a checkpoint: each rank's state saved as its own shard."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank_local", "rank_sharded"]


def rank_sharded(local: torch.Tensor) -> torch.Tensor:
    """`local` as this rank's row of a `(world_size, *shape)` DTensor when a process group is up.

    `torch.distributed.checkpoint` treats plain tensors saved under one key on
    several ranks as replicas and keeps a single rank's copy; local metric states
    differ per rank, so each is saved as its own shard. Plain tensors otherwise.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    world_size = dist.get_world_size()
    mesh = DeviceMesh.from_group(dist.group.WORLD, local.device.type)
    shape = (world_size, *local.shape)
    stride = (local.numel(), *local.contiguous().stride())
    return DTensor.from_local(
        local.unsqueeze(0), mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
    )


def rank_local(saved: Any, owner: str) -> torch.Tensor:
    """The tensor to restore from a saved entry: a plain tensor, or this rank's row of `rank_sharded`."""
    if dist.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(saved, DTensor):
            local = saved.to_local()
            if local.dim() == 0 or local.shape[0] != 1:
                raise ValueError(
                    f"{owner}: saved DTensor has local shape {tuple(local.shape)}, expected one row per rank"
                )
            return local[0]
    try:
        return torch.as_tensor(saved)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{owner}: saved state must be a tensor, got {type(saved).__name__}") from error
