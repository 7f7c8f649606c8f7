"""`MetricAccumulator`: one linearly reducible tensor updated in place."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.metric._inputs import nonfinite_count
from torchtelemetry.metric._shards import rank_local, rank_sharded
from torchtelemetry.metric._staged_rows import StagedRows, entry_offset
from torchtelemetry.metric._staging import COUNTED_DTYPES, StagePart, UpdateStage
from torchtelemetry.sync import GroupLike, ReduceOp

__all__ = ["DEFAULT_STATE_DTYPE", "MetricAccumulator", "ReduceOp"]

DEFAULT_STATE_DTYPE = torch.float64
"""State dtype of the built-in metrics: integers stay exact up to 2**53."""
_is_compiling = torch.compiler.is_compiling
_INT = frozenset({int})
_BINDING_SLOTS = frozenset({"_binding", "_offsets", "_rows"})
"""What ties an accumulator to its collector's buffers: a copy or an unpickled one has none of it."""


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

    Adopted with a stage (`AsyncMetricCollector.bind()`), a float64 state's updates of one entry by
    a Python number or a 0-d tensor are staged and applied with every other metric's in a few tensor
    ops (`UpdateStage`): at `Telemetry.step()`, before a collection, and before `local` or `value`
    is read.
    """

    __slots__ = (
        "_at",
        "_binding",
        "_initial",
        "_local",
        "_offsets",
        "_rows",
        "_scalar",
        "_synced",
        "reduce_op",
    )

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
        self._rows: StagedRows | None = None
        """Where this state's updates are staged (None: they run at once)."""
        self._at = 0
        """This state's first entry in the staged buffer."""
        self._offsets: dict[int | tuple[int, ...], int] = {}
        """The staged buffer offset of each entry index staged so far (`_offset`)."""
        self._scalar = initial.dim() == 0

    def __getstate__(self) -> dict[str, Any]:
        """A copied or unpickled accumulator is bound nowhere (and holds every update made)."""
        self.apply_staged()
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot not in _BINDING_SLOTS}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for slot, value in state.items():
            setattr(self, slot, value)
        self._binding = None
        self._rows = None
        self._offsets = {}

    @property
    def local(self) -> torch.Tensor:
        """The rank-local state, updated in place (staged updates applied first)."""
        self.apply_staged()
        return self._local

    def host_entries(self) -> memoryview | None:
        """On the CPU, the local state's entries (flattened, staged updates applied) as Python reads
        them: the host memory of the collector's buffer, no tensor op; None for a state on a device
        or not kept in a bound collector's float64 buffer."""
        rows = self._rows
        if rows is None or rows.part.buffer_memory is None:
            return None
        rows.part.flush()
        return rows.part.buffer_memory[self._at : self._at + self._local.numel()]

    @property
    def stage(self) -> UpdateStage | None:
        """The stage this state's updates go to (None: they run at once)."""
        return None if self._rows is None else self._rows.part.stage

    def apply_staged(self) -> None:
        """Apply the updates staged for this state's bucket (with every other state's there: one
        flush)."""
        if self._rows is not None:
            self._rows.part.flush()

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
        return self.local

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
        rows = self._rows
        if (
            rows is not None
            and self._scalar
            and rows.add((self._at,), (value, 1.0) if self.reduce_op is ReduceOp.SUM else (value,))
        ):
            return
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

    def update_at(self, index: int | tuple[int, ...], value: torch.Tensor | float) -> None:
        """Fold `value` (a number or a 0-d tensor) into entry `index` of the local state by this
        accumulator's reduce op (add, max or min), leaving every other entry as it is (NaN and Inf
        included). An `index` of fewer dims than the state folds into that whole slice."""
        rows = self._rows
        if (
            rows is not None
            and (offset := self._offset(index)) is not None
            and rows.add((offset,), (value, 1.0) if self.reduce_op is ReduceOp.SUM else (value,))
        ):
            return
        entry = self._writable()[index]
        if self.reduce_op is ReduceOp.SUM:
            entry.add_(value)
        elif self.reduce_op is ReduceOp.MAX:
            entry.clamp_(min=value)
        else:
            entry.clamp_(max=value)

    def _offset(self, index: int | tuple[int, ...]) -> int | None:
        """The staged buffer offset of entry `index` (None unless an int or a tuple of ints in range:
        indexing the state says what anything else selects), kept per index: a signal stages the same
        few entries every window."""
        if type(index) is int or (type(index) is tuple and _INT.issuperset(map(type, index))):
            offset = self._offsets.get(index)
            if offset is None and (offset := entry_offset(self._local.shape, self._at, index)) is not None:
                self._offsets[index] = offset
            return offset
        return None

    def add_at(self, index: int | tuple[int, ...], value: torch.Tensor | float) -> None:
        """`update_at` of a SUM accumulator: add `value` to entry `index` only."""
        if self.reduce_op is not ReduceOp.SUM:
            raise TypeError(f"add_at needs a SUM accumulator, got {self.reduce_op.name}")
        self.update_at(index, value)

    def add_product(self, value: torch.Tensor | float, weight: torch.Tensor | float) -> None:
        """Add `value * weight` (broadcast to this accumulator's shape, computed in its dtype);
        SUM only."""
        if self.reduce_op is not ReduceOp.SUM:
            raise TypeError(f"add_product needs a SUM accumulator, got {self.reduce_op.name}")
        rows = self._rows
        if rows is not None and self._scalar and rows.add((self._at,), (value, weight)):
            return
        local = self._writable()
        if isinstance(weight, torch.Tensor):
            if isinstance(value, torch.Tensor):
                local.addcmul_(value, weight)
            else:
                local.add_(weight, alpha=value)
        elif isinstance(value, torch.Tensor):
            local.add_(value, alpha=weight)
        else:
            local.add_(float(value) * float(weight))

    def add_with_count(
        self,
        value: torch.Tensor | float,
        counter: MetricAccumulator,
        count: torch.Tensor | float,
        weight: torch.Tensor | float | None = None,
    ) -> None:
        """Add `value` (times `weight`) to this SUM state and `count` to the SUM state `counter`: a
        sum and its count, e.g. a mean's two states. Staged as one update when both are 0-d states of
        one stage and every operand can be staged; otherwise `add_product(value, weight)` (or
        `update(value)`) and `counter.update(count)`, each staged or applied at once as it allows."""
        if self.reduce_op is not ReduceOp.SUM or counter.reduce_op is not ReduceOp.SUM:
            raise TypeError(
                "add_with_count needs SUM accumulators, got "
                f"{self.reduce_op.name} and {counter.reduce_op.name}"
            )
        rows = self._rows
        if (
            rows is not None
            and counter._rows is rows
            and self._scalar
            and counter._scalar
            and rows.add((self._at, counter._at), (value, 1.0 if weight is None else weight, count, 1.0))
        ):
            return
        if weight is None:
            self.update(value)
        else:
            self.add_product(value, weight)
        counter.update(count)

    def add_at_flat(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Add `values` (broadcast to `positions`' shape) at the flat `positions` of the local state
        (repeats add up), in one op, at once: a batch's many entries (a histogram's buckets); SUM
        only."""
        if self.reduce_op is not ReduceOp.SUM:
            raise TypeError(f"add_at_flat needs a SUM accumulator, got {self.reduce_op.name}")
        local = self._writable()
        (local if local.dim() == 1 else local.view(-1)).index_put_((positions,), values, accumulate=True)

    def count_nonfinite_at(self, index: int, value: torch.Tensor) -> None:
        """Add the number of NaN and +-Inf entries of the floating point (or complex) tensor `value`
        to entry `index` (no host sync); SUM only."""
        rows = self._rows
        if (
            rows is not None
            and self.reduce_op is ReduceOp.SUM
            and value.dtype in COUNTED_DTYPES
            and (offset := self._offset(index)) is not None
            and rows.add((~offset,), (value, 0.0))  # x * 0: NaN exactly where x is not finite
        ):
            return
        self.add_at(index, nonfinite_count(value))

    def _writable(self) -> torch.Tensor:
        """The local state to update in place. Under torch.compile, a view of it: AOT autograd
        silently drops an in-place update of a 0-d float64/int CPU graph input, but keeps one
        made through a view of it (eagerly the view would only cost time)."""
        return self._local.view_as(self._local) if _is_compiling() else self._local

    def reset(self) -> None:
        """Restore the initial state in place."""
        self.local.copy_(self._initial)

    def sync(self, group: GroupLike = None) -> None:
        """Reduce the local state across `group` into `value` (one collective)."""
        from torchtelemetry.metric._sync import sync_accumulators  # _sync imports this module

        sync_accumulators({"accumulator": self}, group=group)

    def to(self, device: torch.device | str) -> MetricAccumulator:
        """Move every tensor to `device`; call before capturing CUDA graphs."""
        self._initial = self._initial.to(device)
        self._local = self.local.to(device)
        self._synced = self._synced.to(device)
        self._rows = None
        if self._binding is not None:
            self._binding.stale = True
        return self

    def adopt(self, storage: torch.Tensor, staged: tuple[StagePart, int] | None = None) -> None:
        """Keep the local state in `storage` from now on (a view of the same shape, dtype and device,
        e.g. a slice of a collector's flat buffer); the current values are copied into it.
        `staged`: where updates of the state are staged from now on (the stage part of `storage`'s
        buffer, and the state's offset in it); None: they run at once."""
        if storage.shape != self._local.shape or storage.dtype != self._local.dtype:
            raise ValueError(
                f"MetricAccumulator.adopt: storage is {storage.dtype}{tuple(storage.shape)}, expected "
                f"{self._local.dtype}{tuple(self._local.shape)}"
            )
        if storage.device != self._local.device:
            raise ValueError(
                f"MetricAccumulator.adopt: storage is on {storage.device}, not {self._local.device}"
            )
        storage.copy_(self.local)
        self._local = storage
        self._rows = None if staged is None else staged[0].rows_for(self.reduce_op)
        self._at = 0 if staged is None else staged[1]
        self._offsets = {}

    def adopt_synced(self, storage: torch.Tensor) -> None:
        """Keep the synchronized state in `storage` from now on (a view of the same shape and dtype,
        e.g. a slice of a packed sync's buffer, which a sync then reduces in place); the current
        values are copied into it."""
        storage.copy_(self._synced)
        self._synced = storage

    def reading(self, state: torch.Tensor) -> MetricAccumulator:
        """A twin of this accumulator whose local state and `value` are `state` (e.g. a collection
        window's reduced state), bound nowhere; this accumulator is left as it is."""
        twin = _StateReading.__new__(_StateReading)
        twin.reduce_op, twin._initial, twin._local, twin._synced = self.reduce_op, self._initial, state, state
        twin._binding, twin._rows, twin._at, twin._scalar = None, None, 0, state.dim() == 0
        twin._offsets = {}
        return twin

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The local state (a per-rank DTensor shard under a process group, see `rank_sharded`)."""
        return {"local": rank_sharded(self.local.detach().clone())}

    def load_state_dict(self, state: Mapping[str, Any], *, owner: str = "MetricAccumulator") -> None:
        """Copy a saved local state in place; raise `ValueError` naming `owner` on mismatch."""
        if "local" not in state:
            raise ValueError(f"{owner}: state_dict has no 'local' entry (keys: {sorted(state)})")
        saved = rank_local(state["local"], owner)
        if saved.shape != self._local.shape:
            raise ValueError(
                f"{owner}: saved state has shape {tuple(saved.shape)}, expected {tuple(self._local.shape)}"
            )
        self.local.copy_(saved)

    def __repr__(self) -> str:
        return (
            f"MetricAccumulator(reduce_op={self.reduce_op.name}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device})"
        )


class _StateReading(MetricAccumulator):
    """What `MetricAccumulator.reading` returns: `value` and `local` are the state it reads, as it is
    (nothing is staged for it, and no process group decides which state it is), read without a Python
    call: a collection's custom metrics read them in their `compute()` every window."""

    __slots__ = ()
    value = local = property(operator.attrgetter("_local"))  # type: ignore[assignment]
