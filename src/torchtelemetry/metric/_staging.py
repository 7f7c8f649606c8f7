"""`UpdateStage`: the updates of bound metrics, staged on the host and applied in a few tensor ops.

After `AsyncMetricCollector.bind()` every local state is a view of one flat buffer per bucket
(`MetricAccumulator.adopt`). An update that folds a 0-d tensor or a Python number into a float64
state launches nothing: the metric checks it as always, and the accumulator stages its operands
(appends to host lists). `flush()` applies everything staged since the last one, however many
metrics were updated: the staged tensors are copied into float64 rows (one `_foreach_copy_` per
dtype), the Python numbers come as one host row (written in place on the CPU, one copy to a device),
the two rows of the sums are multiplied (value x weight; x 1 for a plain add, x 0 for a non-finite
count, whose NaN marks the count: on the CPU the count is read in host memory instead, no op), and
one `index_add_` adds them into the SUM buffer; `scatter_reduce_` folds the maxima and minima into
the MAX buffer. On the CPU a part of up to `HOST_FOLDS` entries is applied in the buffer's memory
instead, no op: each staged tensor read there (`tolist`), the same float64 products, sums and
comparisons in Python (a launch-bound step's few updates; more take the ops, the device's path).
Float64 arithmetic in the order the updates came, so the states are the ones the updates would have
made one by one.

Not staged (the update runs at once, as without a collector): inside `torch.compile` or a CUDA
graph capture (the update belongs in the graph), states that are not float64, operands that are not
a Python number or a 0-d `torch.Tensor` (not a subclass) of a real dtype on the state's device
outside autograd. A staged tensor is read at the flush: modified in place in between, the flush
raises naming the state (docs/metrics.md, "Staged updates").
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from typing import Any

import torch

from torchtelemetry.metric._staged_rows import STAGED_DTYPES, StagedRows, version_of
from torchtelemetry.sync import BucketKey, ReduceOp

__all__ = ["COUNTED_DTYPES", "STAGED_DTYPES", "StagePart", "UpdateStage"]

COUNTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes of the 0-d tensors whose non-finite count is staged (the others are counted at once)."""
MAX_STAGED = 4096
"""Entries staged before a flush runs at once (a loop that never calls `Telemetry.step()`)."""
HOST_FOLDS = 32
"""Entries of a CPU buffer's part applied in its host memory by Python float64 arithmetic (more: by
ops, as on a device)."""
_STAGED = torch.float64


class StagePart:
    """What is staged for one float64 bucket buffer of an `UpdateStage`: its `rows` (a state stages
    into the rows of its reduce op, `rows_for`), applied to the buffer by `flush`."""

    rows: tuple[StagedRows, ...]

    def __init__(
        self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]], host: memoryview | None
    ) -> None:
        self.stage = stage
        self.buffer = buffer
        self.buffer_memory = host
        """On the CPU, the buffer's memory as Python writes it (None: a device, or not at hand); not the
        staged rows' host block (`StagedRows.gather`)."""
        self._names = sorted(names)

    def _new_rows(self, count: int) -> StagedRows:
        """New rows of `count` operands an entry, staged into this part."""
        return StagedRows(count, self.buffer.device, self, MAX_STAGED)

    def rows_for(self, op: ReduceOp) -> StagedRows:
        """Where a state of reduce op `op` in this bucket stages its entries."""
        raise NotImplementedError

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
        for rows in self.rows:
            if rows.marks:
                break
        else:
            return
        stage = self.stage
        if threading.get_ident() != stage.thread:
            stage.check_thread(self.pending)
        try:
            for rows in self.rows:
                if list(map(version_of, rows.tensors)) != rows.versions:
                    raise RuntimeError(
                        f"metric states {self._changed()}: a tensor given to update() was modified in place "
                        "before the update was applied (at the next Telemetry.step() or read of the state), "
                        "so the value it had is gone and the updates staged with it are dropped; pass a "
                        "tensor nothing writes to afterwards (e.g. value.clone(), or the result of an "
                        "operation)"
                    )
            self.apply()
        finally:
            for rows in self.rows:
                rows.clear()

    def _changed(self) -> list[str]:
        """The states whose staged tensor was modified in place since it was staged."""
        offsets = {mark if mark >= 0 else ~mark for rows in self.rows for mark in rows.changed()}
        return sorted({self.name(offset) for offset in offsets})

    @property
    def pending(self) -> int:
        """Entries staged here and not applied yet."""
        return sum(len(rows.marks) for rows in self.rows)

    def apply(self) -> None:
        raise NotImplementedError


class _Sums(StagePart):
    """Sums: rows (value, factor) added as value x factor at their offsets by one `index_add_`.
    A non-finite count stages its value with factor 0 (x * 0 is NaN exactly when x is not finite),
    marked by its offset's complement (`~offset`, negative); on the CPU the staged values are host
    memory, and a count's row becomes (1 or 0, 1) there, read in place (no op). On the CPU up to
    `HOST_FOLDS` entries are added in the buffer's memory instead (`_add_in_place`: no op)."""

    def __init__(
        self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]], host: memoryview | None
    ) -> None:
        super().__init__(stage, buffer, names, host)
        self._sums = self._new_rows(2)
        self.rows = (self._sums,)

    def rows_for(self, op: ReduceOp) -> StagedRows:
        return self._sums

    def apply(self) -> None:
        rows = self._sums
        if self.buffer_memory is not None and len(rows.marks) <= HOST_FOLDS:
            _add_in_place(self.buffer_memory, rows.marks, rows.numbers())
            return
        (values, factors), (offsets, counted), host = rows.gather(self._prepare)
        if host is not None:  # the CPU: each count's row, (x, 0) -> (1 or 0, 1), in host memory
            for slot in counted:
                host[slot], host[slot + 1] = 0.0 if math.isfinite(host[slot]) else 1.0, 1.0
            counted = None
        added = values * factors
        if counted is not None:  # a count's 0 or NaN -> 0 or 1; NaN stays NaN elsewhere
            added = torch.where(added.isnan(), counted, added)
        self.buffer.index_add_(0, offsets, added)

    def _prepare(self, marks: list[int]) -> tuple[torch.Tensor, Any]:
        """The offsets of a pattern of entries, and where its non-finite counts are: on the CPU the
        host slot of each count's value; on a device (None: no count) what a NaN product becomes in
        each entry: 1 in a count, NaN elsewhere."""
        offsets = self.constant([mark if mark >= 0 else ~mark for mark in marks])
        if self.buffer.device.type == "cpu":
            return offsets, [2 * entry for entry, mark in enumerate(marks) if mark < 0]
        if all(mark >= 0 for mark in marks):
            return offsets, None
        return offsets, self.constant([1.0 if mark < 0 else math.nan for mark in marks], _STAGED)


class _Extrema(StagePart):
    """Maxima and minima (the MIN states sit, not negated, in the MAX buffer): one row each, folded
    by `scatter_reduce_` (NaN wins, as `torch.maximum` lets it). On the CPU up to `HOST_FOLDS`
    entries are folded in the buffer's memory instead (`_fold_in_place`: no op)."""

    def __init__(
        self, stage: UpdateStage, buffer: torch.Tensor, names: list[tuple[int, str]], host: memoryview | None
    ) -> None:
        super().__init__(stage, buffer, names, host)
        self._maxima = self._new_rows(1)
        self._minima = self._new_rows(1)
        self.rows = (self._maxima, self._minima)

    def rows_for(self, op: ReduceOp) -> StagedRows:
        return self._minima if op is ReduceOp.MIN else self._maxima

    def apply(self) -> None:
        for reduce, rows in (("amax", self._maxima), ("amin", self._minima)):
            if not rows.marks:
                continue
            if self.buffer_memory is not None and len(rows.marks) <= HOST_FOLDS:
                _fold_in_place(self.buffer_memory, rows.marks, rows.numbers(), larger=reduce == "amax")
                continue
            (values,), offsets, _ = rows.gather(self.constant)
            self.buffer.scatter_reduce_(0, offsets, values, reduce)


def _add_in_place(host: memoryview, marks: list[int], operands: list[Any]) -> None:
    """Add each entry's value x factor (`operands`: two an entry) into `host` at its mark, in order,
    in float64 (what `index_add_` of the products makes); an entry marked `~offset` (a non-finite
    count) adds 1 at `offset` when its value is not finite."""
    for mark, value, factor in zip(marks, operands[0::2], operands[1::2], strict=True):
        if mark >= 0:
            host[mark] += float(value) * float(factor)
        elif not math.isfinite(value):
            host[~mark] += 1.0


def _fold_in_place(host: memoryview, offsets: list[int], values: list[float], *, larger: bool) -> None:
    """Fold each of `values` into `host` at its offset, in order: the larger (else the smaller) of the
    two, NaN wherever either is NaN (`scatter_reduce_`'s amax / amin, in float64)."""
    for offset, value in zip(offsets, values, strict=True):
        current = host[offset]
        if value != value or (value > current if larger else value < current):  # value != value: NaN
            host[offset] = value


class UpdateStage:
    """The staged updates of the metrics whose states live in `buffers` (a collector's flat buffers,
    by bucket): float64 buckets are staged, others updated at once. `names` gives the state at each
    (bucket, offset) for error messages; `host`, on the CPU, each float64 buffer's memory as Python
    writes it (`Slot.host`). Updated and flushed on the thread that built it."""

    def __init__(
        self,
        buffers: Mapping[BucketKey, torch.Tensor],
        names: Mapping[tuple[BucketKey, int], str],
        host: Mapping[BucketKey, memoryview] | None = None,
    ):
        self._parts: dict[BucketKey, StagePart] = {}
        self.thread = threading.get_ident()
        """The thread that stages and flushes (the metrics' training thread)."""
        for key, buffer in buffers.items():
            if buffer.dtype != _STAGED:
                continue
            named = [(offset, name) for (owner, offset), name in names.items() if owner == key]
            part = _Sums if key.reduce_op is ReduceOp.SUM else _Extrema
            self._parts[key] = part(self, buffer, named, None if host is None else host.get(key))
        self._in_order = tuple(self._parts.values())

    def part(self, key: BucketKey) -> StagePart | None:
        """What stages into bucket `key` (None: its states are updated at once)."""
        return self._parts.get(key)

    @property
    def pending(self) -> int:
        """Entries staged and not applied yet."""
        return sum(part.pending for part in self._in_order)

    def flush(self) -> None:
        """Apply every staged update (a fixed number of tensor ops, no host sync; reading one state
        flushes the part of its bucket only). Raises a `RuntimeError` on another thread than the
        stage's (the metrics' training thread) while updates are staged, and one naming the states
        whose staged tensor was modified in place since `update()` (the updates staged with it are
        dropped: the value is gone)."""
        for part in self._in_order:
            part.flush()

    def check_thread(self, pending: int) -> None:
        """Raise unless on the stage's thread (`pending` updates staged)."""
        if threading.get_ident() != self.thread:
            raise RuntimeError(
                f"{pending} metric updates are staged on thread {self._thread_name()}, and their "
                f"state was read from thread {threading.current_thread().name!r}: read a bound metric's "
                "state (compute(), sync(), state_dict(), local) on the thread that updates it"
            )

    def close(self) -> None:
        """Flush, then stage nothing more: every later update runs at once (an unbound collector)."""
        self.flush()
        for part in self._in_order:
            for rows in part.rows:
                rows.open = False

    def _thread_name(self) -> str:
        for thread in threading.enumerate():
            if thread.ident == self.thread:
                return repr(thread.name)
        return str(self.thread)
