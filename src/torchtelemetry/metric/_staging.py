"""`UpdateStage`: the updates of bound metrics, staged on the host and applied in a few tensor ops.

After `AsyncMetricCollector.bind()` every local state is a view of one flat buffer per bucket
(`MetricAccumulator.adopt`). An update that folds a 0-d tensor or a Python number into a float64
state launches nothing: the metric checks it as always, and the accumulator stages its operands
(appends to host lists). `flush()` applies everything staged since the last one, however many
metrics were updated: the staged tensors are copied into float64 rows (one `_foreach_copy_` per
dtype), the Python numbers come as one host row (written in place on the CPU, one copy to a device),
the two rows of the sums are multiplied (value x weight; x 1 for a plain add, x 0 for a non-finite
count, whose NaN marks the count), and one `index_add_` adds them into the SUM buffer;
`scatter_reduce_` folds the maxima and minima into the MAX buffer. Float64 arithmetic in the order
the updates came, so the states are the ones the updates would have made one by one.

Not staged (the update runs at once, as without a collector): inside `torch.compile` or a CUDA
graph capture (the update belongs in the graph), states that are not float64, operands that are not
a Python number or a 0-d tensor of a real dtype on the state's device outside autograd. A staged
tensor is read at the flush: modified in place in between, the flush raises naming the state
(docs/metrics.md, "Staged updates").
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric._inputs import READY_DTYPES
from torchtelemetry.metric._staged_rows import StagedRows
from torchtelemetry.sync import BucketKey, ReduceOp

__all__ = ["COUNTED_DTYPES", "STAGED_DTYPES", "StagePart", "UpdateStage"]

STAGED_DTYPES = READY_DTYPES
"""Dtypes of the 0-d tensors staged: each converts exactly to float64 (int64 up to 2**53, as a
float64 state holds it)."""
COUNTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes of the 0-d tensors whose non-finite count is staged (the others are counted at once)."""
MAX_STAGED = 4096
"""Entries staged before a flush runs at once (a loop that never calls `Telemetry.step()`)."""
_STAGED = torch.float64
_is_compiling = torch.compiler.is_compiling


class StagePart:
    """What is staged for one float64 bucket buffer of an `UpdateStage`."""

    def __init__(self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]]) -> None:
        self.stage = stage
        self.accepts = stage.accepts
        """`UpdateStage.accepts` of the stage."""
        self.buffer = buffer
        self._names = sorted(names)

    def constant(self, values: list[int] | list[float], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """`values` as a tensor on the buffer's device (a non-blocking copy, from pinned memory on
        CUDA): made once per pattern of updates, kept with its plan (`StagedRows.gather`)."""
        host = torch.tensor(values, dtype=dtype)
        if self.buffer.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.buffer.device, non_blocking=True)

    def name(self, offset: int) -> str:
        """The state holding buffer entry `offset`."""
        found = bisect.bisect_right(self._names, (offset, "\uffff")) - 1
        return self._names[found][1] if found >= 0 else f"entry {offset}"

    def flush(self) -> None:
        """Apply what is staged here (see `UpdateStage.flush`)."""
        pending = self.pending
        if not pending:
            return
        self.stage.check_thread(pending)
        try:
            changed = self.changed()
            if changed:
                raise RuntimeError(
                    f"metric states {sorted({self.name(offset) for offset in changed})}: a tensor given to "
                    "update() was modified in place before the update was applied (at the next "
                    "Telemetry.step() or read of the state), so the value it had is gone and the updates "
                    "staged with it are dropped; pass a tensor nothing writes to afterwards (e.g. "
                    "value.clone(), or the result of an operation)"
                )
            self.apply()
        finally:
            self.clear()

    def fold(self, offset: int, value: torch.Tensor | float, op: ReduceOp) -> None:
        raise NotImplementedError

    def add_product(self, offset: int, value: torch.Tensor | float, weight: torch.Tensor | float) -> None:
        raise TypeError("add_product needs a SUM state")

    def count_nonfinite(self, offset: int, value: torch.Tensor) -> None:
        raise TypeError("a non-finite count needs a SUM state")

    @property
    def pending(self) -> int:
        raise NotImplementedError

    def changed(self) -> list[int]:
        """Offsets of the entries whose staged tensor was modified in place since it was staged."""
        raise NotImplementedError

    def apply(self) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError


class _Sums(StagePart):
    """Sums: rows (value, factor) added as value x factor at their offsets by one `index_add_`.
    A non-finite count stages its value with factor 0 (x * 0 is NaN exactly when x is not finite),
    marked by its offset's complement (`~offset`, negative)."""

    def __init__(self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]]) -> None:
        super().__init__(stage, buffer, names)
        self._rows = StagedRows(2, buffer.device)

    def fold(self, offset: int, value: torch.Tensor | float, op: ReduceOp) -> None:
        if self._rows.add(offset, value, 1.0) >= MAX_STAGED:
            self.flush()

    def add_product(self, offset: int, value: torch.Tensor | float, weight: torch.Tensor | float) -> None:
        if self._rows.add(offset, value, weight) >= MAX_STAGED:
            self.flush()

    def count_nonfinite(self, offset: int, value: torch.Tensor) -> None:
        if self._rows.add(~offset, value, 0.0) >= MAX_STAGED:
            self.flush()

    @property
    def pending(self) -> int:
        return len(self._rows.marks)

    def changed(self) -> list[int]:
        return [mark if mark >= 0 else ~mark for mark in self._rows.changed()]

    def apply(self) -> None:
        (values, factors), (offsets, counted) = self._rows.gather(self._prepare)
        added = values * factors
        if counted is not None:  # a count's 0 or NaN -> 0 or 1; NaN stays NaN elsewhere
            added = torch.where(added.isnan(), counted, added)
        self.buffer.index_add_(0, offsets, added)

    def _prepare(self, marks: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The offsets of a pattern of entries, and (None: no non-finite count among them) what a
        NaN product becomes in each: 1 in a count, NaN elsewhere."""
        offsets = self.constant([mark if mark >= 0 else ~mark for mark in marks])
        if all(mark >= 0 for mark in marks):
            return offsets, None
        return offsets, self.constant([1.0 if mark < 0 else math.nan for mark in marks], _STAGED)

    def clear(self) -> None:
        self._rows.clear()


class _Extrema(StagePart):
    """Maxima and minima (the MIN states sit, not negated, in the MAX buffer): one row each, folded
    by `scatter_reduce_` (NaN wins, as `torch.maximum` lets it)."""

    def __init__(self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]]) -> None:
        super().__init__(stage, buffer, names)
        self._maxima = StagedRows(1, buffer.device)
        self._minima = StagedRows(1, buffer.device)

    def fold(self, offset: int, value: torch.Tensor | float, op: ReduceOp) -> None:
        if (self._minima if op is ReduceOp.MIN else self._maxima).add(offset, value) >= MAX_STAGED:
            self.flush()

    @property
    def pending(self) -> int:
        return len(self._maxima.marks) + len(self._minima.marks)

    def changed(self) -> list[int]:
        return self._maxima.changed() + self._minima.changed()

    def apply(self) -> None:
        for reduce, rows in (("amax", self._maxima), ("amin", self._minima)):
            if rows.marks:
                (values,), offsets = rows.gather(self.constant)
                self.buffer.scatter_reduce_(0, offsets, values, reduce)

    def clear(self) -> None:
        self._maxima.clear()
        self._minima.clear()


class UpdateStage:
    """The staged updates of the metrics whose states live in `buffers` (a collector's flat buffers,
    by bucket): float64 buckets are staged, others updated at once. `names` gives the state at each
    (bucket, offset) for error messages. Updated and flushed on the thread that built it."""

    def __init__(self, buffers: Mapping[BucketKey, torch.Tensor], names: Mapping[tuple[BucketKey, int], str]):
        self._parts: dict[BucketKey, StagePart] = {}
        self._open = True
        self._thread = threading.get_ident()
        self.device = torch.device("cpu")
        for key, buffer in buffers.items():
            if buffer.dtype != _STAGED:
                continue
            named = [(offset, name) for (owner, offset), name in names.items() if owner == key]
            part = _Sums if key.reduce_op is ReduceOp.SUM else _Extrema
            self._parts[key] = part(self, buffer, named)
            self.device = buffer.device
        self._cpu = self.device.type == "cpu"
        self._cuda = self.device.type == "cuda"

    def part(self, key: BucketKey) -> StagePart | None:
        """What stages into bucket `key` (None: its states are updated at once)."""
        return self._parts.get(key)

    def accepts(self, value: Any) -> bool:
        """Whether `value` can be staged now: a Python number (not a bool), or a 0-d tensor of a
        `STAGED_DTYPES` dtype on this stage's device outside autograd; never while compiling or
        capturing a CUDA graph, nor after `close()`."""
        kind = type(value)
        if kind is float or kind is int:
            return self._open and not (
                _is_compiling() or (self._cuda and torch.cuda.is_current_stream_capturing())
            )
        return (
            isinstance(value, torch.Tensor)
            and self._open
            and not _is_compiling()
            and value.dtype in STAGED_DTYPES
            and not (value.requires_grad or value.dim())
            and (value.is_cpu if self._cpu else value.device == self.device)
            and not (self._cuda and torch.cuda.is_current_stream_capturing())
        )

    @property
    def pending(self) -> int:
        """Entries staged and not applied yet."""
        return sum(part.pending for part in self._parts.values())

    def flush(self) -> None:
        """Apply every staged update (a fixed number of tensor ops, no host sync; reading one state
        flushes the part of its bucket only). Raises a `RuntimeError` on another thread than the
        stage's (the metrics' training thread) while updates are staged, and one naming the states
        whose staged tensor was modified in place since `update()` (the updates staged with it are
        dropped: the value is gone)."""
        for part in self._parts.values():
            part.flush()

    def check_thread(self, pending: int) -> None:
        """Raise unless on the stage's thread (`pending` updates staged)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"{pending} metric updates are staged on thread {self._thread_name()}, and their "
                f"state was read from thread {threading.current_thread().name!r}: read a bound metric's "
                "state (compute(), sync(), state_dict(), local) on the thread that updates it"
            )

    def close(self) -> None:
        """Flush, then stage nothing more: every later update runs at once (an unbound collector)."""
        self.flush()
        self._open = False

    def _thread_name(self) -> str:
        for thread in threading.enumerate():
            if thread.ident == self._thread:
                return repr(thread.name)
        return str(self._thread)
