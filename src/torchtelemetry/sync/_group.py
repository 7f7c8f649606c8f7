"""Resolve the `group=` argument every sync function takes."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, TypeAlias, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GroupLike", "comm_device", "group_rank", "group_world_size", "resolve_group"]

GroupLike: TypeAlias = Union["dist.ProcessGroup", "DeviceMesh", "tuple[DeviceMesh, int | str]", None]
"""A ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim) pair, or None for the default group."""

_ACCEPTED = "a ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, mesh_dim) tuple, or None"


def resolve_group(group: GroupLike, *, op: str) -> dist.ProcessGroup | None:
    """The ProcessGroup to reduce over, or None to run locally (no process group at all).

    `op` names the calling function in error messages.
    """
    # What new_group() gives the ranks it leaves out: this rank is in no group of its own.
    not_a_member = (
        dist.is_available() and isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    )
    if group is not None and not not_a_member and not _is_group_like(group):
        raise TypeError(f"{op}: group must be {_ACCEPTED}, got {type(group).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        if group is None:
            return None
        raise RuntimeError(
            f"{op}: group={group!r} was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group() first, or pass group=None to run locally"
        )
    if group is None:
        resolved = dist.group.WORLD
    elif not_a_member:
        resolved = None
    elif isinstance(group, dist.ProcessGroup):
        resolved = group
    else:
        resolved = _mesh_group(group, op)
    if resolved is None or dist.get_rank(resolved) < 0:
        warnings.warn(
            f"{op}: rank {dist.get_rank()} is not in the given group; running locally",
            stacklevel=3,
        )
        return None
    return resolved


def _is_group_like(group: object) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, (dist.ProcessGroup, DeviceMesh)):
        return True
    return isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh)


def _mesh_group(group: object, op: str) -> dist.ProcessGroup:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{op}: got a {group.ndim}-D DeviceMesh with dims {group.mesh_dim_names}, but a 1-D "
                "mesh is needed; pass (mesh, mesh_dim) or mesh[dim_name] to pick the dim to reduce over"
            )
        return group.get_group()
    mesh, dim = group  # type: ignore[misc]
    return mesh.get_group(dim)


def group_world_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in a resolved group (1 when running locally)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in a resolved group (0 when running locally)."""
    return 0 if group is None else dist.get_rank(group)


def comm_device(group: dist.ProcessGroup, fallback: torch.device | None = None) -> torch.device:
    """The device for small control tensors on `group` (CUDA under NCCL, else CPU)."""
    if fallback is not None:
        return fallback
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
