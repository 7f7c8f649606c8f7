"""`MetricAccumulator`: one linearly reducible tensor updated in place."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.sync import GroupLike, ReduceOp

__all__ = [
    "DEFAULT_STATE_DTYPE",
    "MetricAccumulator",
    "ReduceOp",
    "rank_local",
    "rank_sharded",
    "same_identity",
    "state_identity",
]

DEFAULT_STATE_DTYPE = torch.float64
"""State dtype of the built-in metrics: integers stay exact up to 2**53."""


def state_identity(accumulators: Iterable[MetricAccumulator]) -> tuple[object, ...]:
    """Each accumulator and its local tensor, in order: the same objects (`same_identity`) until an
    accumulator is replaced or moved (`to()`, `adopt()`). For what a blocking call caches."""
    return tuple(item for accumulator in accumulators for item in (accumulator, accumulator._local))


def same_identity(first: tuple[object, ...], second: tuple[object, ...]) -> bool:
    """Whether two `state_identity`s hold the same objects (compared by `is`)."""
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))


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


def _check_state_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_signed):
        raise TypeError(
            f"{what}: state dtype {dtype} cannot be reduced by negation (MIN folds into MAX); "
            "use a floating point or signed integer dtype"
        )


class MetricAccumulator:
    """A local tensor updated in place every step, plus the synchronized copy.

    The local tensor keeps its storage for the life of the accumulator (only
    `to()` and `adopt()` move it, both set-up steps: `AsyncMetricCollector.bind()`
    adopts every state into one flat buffer per bucket), so a CUDA graph that
    captured `update()` after set-up stays attached. `value` is what `compute()`
    reads: the synchronized state filled by `sync()` when several ranks run, the
    local state in a single process.
    """

    __slots__ = ("_binding", "_initial", "_local", "_synced", "reduce_op")

    def __init__(
        self,
        initial_value: torch.Tensor | float | int | list[float],
        reduce_op: ReduceOp | str = ReduceOp.SUM,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        initial = torch.as_tensor(initial_value, dtype=dtype, device=device).detach().clone()
        _check_state_dtype(initial.dtype, "MetricAccumulator")
        self.reduce_op = ReduceOp(reduce_op)
        self._initial = initial
        self._local = initial.clone()
        self._synced = initial.clone()
        self._binding: Any = None
        """The `MetricBinding` of the collector keeping this state, told when `to()` moves it."""

    def __getstate__(self) -> dict[str, Any]:
        """A copied or unpickled accumulator is bound nowhere."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "_binding"}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self._binding = None

    @property
    def local(self) -> torch.Tensor:
        """The rank-local state, updated in place."""
        return self._local

    @property
    def initial(self) -> torch.Tensor:
        """The state after `reset()`."""
        return self._initial

    @property
    def value(self) -> torch.Tensor:
        """The state `compute()` reads: under a process group of more than one rank, the state of the
        last `sync()`; else (one process) the local state, which is then the global one. (A
        collection computes a custom metric on a twin whose accumulators are `reading()` the
        window's state.)"""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return self._synced
        return self._local

    @property
    def shape(self) -> torch.Size:
        return self._local.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    def update(self, value: torch.Tensor | float) -> None:
        """Fold `value` (already reduced to this accumulator's shape) into the local state."""
        local = self._writable()
        if self.reduce_op is ReduceOp.SUM:
            local.add_(value)
            return
        if not isinstance(value, torch.Tensor):  # a fill on the device, not a blocking host-to-device copy
            value = torch.full((), value, dtype=local.dtype, device=local.device)
        if self.reduce_op is ReduceOp.MAX:
            local.copy_(torch.maximum(local, value))
        else:
            local.copy_(torch.minimum(local, value))

    def add_at(self, index: int, value: torch.Tensor | float) -> None:
        """Add `value` (a number or a 0-d tensor) to entry `index` of the local state's first dim,
        leaving every other entry as it is (NaN and Inf included); SUM only."""
        if self.reduce_op is not ReduceOp.SUM:
            raise TypeError(f"add_at needs a SUM accumulator, got {self.reduce_op.name}")
        self._writable()[index].add_(value)

    def add_product(self, value: torch.Tensor, weight: torch.Tensor) -> None:
        """Add `value * weight` (broadcast to this accumulator's shape) in one fused op; SUM only."""
        if self.reduce_op is not ReduceOp.SUM:
            raise TypeError(f"add_product needs a SUM accumulator, got {self.reduce_op.name}")
        self._writable().addcmul_(value, weight)

    def _writable(self) -> torch.Tensor:
        """The local state to update in place. Under torch.compile, a view of it: AOT autograd
        silently drops an in-place update of a 0-d float64/int CPU graph input, but keeps one
        made through a view of it (eagerly the view would only cost time)."""
        return self._local.view_as(self._local) if torch.compiler.is_compiling() else self._local

    def reset(self) -> None:
        """Restore the initial state in place."""
        self._local.copy_(self._initial)

    def sync(self, group: GroupLike = None) -> None:
        """Reduce the local state across `group` into `value` (one collective)."""
        from torchtelemetry.metric._sync import sync_accumulators  # _sync imports this module

        sync_accumulators({"accumulator": self}, group=group)

    def to(self, device: torch.device | str) -> MetricAccumulator:
        """Move every tensor to `device`; call before capturing CUDA graphs."""
        self._initial = self._initial.to(device)
        self._local = self._local.to(device)
        self._synced = self._synced.to(device)
        if self._binding is not None:
            self._binding.stale = True
        return self

    def adopt(self, storage: torch.Tensor) -> None:
        """Keep the local state in `storage` from now on (a view of the same shape, dtype and device,
        e.g. a slice of a collector's flat buffer); the current values are copied into it."""
        if storage.shape != self._local.shape or storage.dtype != self._local.dtype:
            raise ValueError(
                f"MetricAccumulator.adopt: storage is {storage.dtype}{tuple(storage.shape)}, expected "
                f"{self._local.dtype}{tuple(self._local.shape)}"
            )
        if storage.device != self._local.device:
            raise ValueError(
                f"MetricAccumulator.adopt: storage is on {storage.device}, not {self._local.device}"
            )
        storage.copy_(self._local)
        self._local = storage

    def reading(self, state: torch.Tensor) -> MetricAccumulator:
        """A twin of this accumulator whose local state and `value` are `state` (e.g. a collection
        window's reduced state), bound nowhere; this accumulator is left as it is."""
        twin = MetricAccumulator.__new__(MetricAccumulator)
        twin.reduce_op, twin._initial, twin._local, twin._synced = self.reduce_op, self._initial, state, state
        twin._binding = None
        return twin

    def flat_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """1-D views of the local and the synchronized state (valid until `to()`), for packed syncs."""
        return self._local.view(-1), self._synced.view(-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The local state (a per-rank DTensor shard under a process group, see `rank_sharded`)."""
        return {"local": rank_sharded(self._local.detach().clone())}

    def load_state_dict(self, state: Mapping[str, Any], *, owner: str = "MetricAccumulator") -> None:
        """Copy a saved local state in place; raise `ValueError` naming `owner` on mismatch."""
        if "local" not in state:
            raise ValueError(f"{owner}: state_dict has no 'local' entry (keys: {sorted(state)})")
        saved = rank_local(state["local"], owner)
        if saved.shape != self._local.shape:
            raise ValueError(
                f"{owner}: saved state has shape {tuple(saved.shape)}, expected {tuple(self._local.shape)}"
            )
        self._local.copy_(saved)

    def __repr__(self) -> str:
        return (
            f"MetricAccumulator(reduce_op={self.reduce_op.name}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )
