"""`StagedRows`: the entries staged for one buffer and one way of folding them, checked as they are
staged (what cannot be staged now is refused whole, and the caller applies it at once), their
operands kept in order until a flush gathers them into a float64 block on the buffer's device."""

from __future__ import annotations

import array
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchtelemetry.metric._inputs import READY_DTYPES

if TYPE_CHECKING:
    from torchtelemetry.metric._staging import StagePart

__all__ = ["STAGED_DTYPES", "StagedRows", "entry_offset", "version_of"]

STAGED_DTYPES = READY_DTYPES
"""Dtypes of the 0-d tensors staged: each converts exactly to float64 (int64 up to 2**53, as a
float64 state holds it)."""
CACHED = 64
"""Blocks (one per number of entries) and plans (one per pattern of entries) kept per rows."""
_STAGED = torch.float64
_TENSOR = torch.Tensor
_NUMBERS = frozenset({float, int})
"""The Python numbers staged as they are (not bool: `type(True)` is bool)."""
_is_compiling = torch.compiler.is_compiling
_capturing = torch.cuda.is_current_stream_capturing
version_of = operator.attrgetter("_version")
"""A tensor's version counter (bumped by every in-place write), read in C: `map(version_of, tensors)`."""


class StagedRows:
    """Entries staged for one buffer: each a mark (an int the caller gives: where it goes) and
    `count` operands, each a Python number (kept on the host) or a 0-d tensor (copied at the flush
    into its float64 slot: one op per dtype). The operands of n entries fill an
    (n, count) float64 block in the order they came.

    A step stages the same entries every time, so what a flush needs beyond the operands (which
    slots each dtype's tensors go to, and what the caller's `prepare` makes of the marks: index
    tensors) is a plan made once per pattern of marks and operand kinds and kept."""

    __slots__ = (
        "_blocks",
        "_cpu",
        "_cuda",
        "_plans",
        "count",
        "device",
        "limit",
        "marks",
        "open",
        "part",
        "slots",
        "tensors",
        "versions",
    )

    def __init__(self, count: int, device: torch.device, part: StagePart, limit: int) -> None:
        self.count = count
        self.device = device
        self._cpu = device.type == "cpu"
        self._cuda = device.type == "cuda"
        self.part = part
        """The stage part that applies these rows (flushed past `limit` entries)."""
        self.limit = limit
        self.open = True
        """False once the stage closed: nothing more is staged."""
        self.marks: list[int] = []
        """Each entry's mark."""
        self.slots: list[Any] = []
        """Each operand's kind and value, in order: (None, the number) or (the tensor's dtype, 0.0)."""
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        """Each staged tensor's version when staged: one changed in place since is caught."""
        self._blocks: dict[int, tuple[torch.Tensor, Any, list[torch.Tensor]]] = {}
        self._plans: dict[tuple[tuple[int, ...], tuple[torch.dtype | None, ...]], tuple[Any, ...]] = {}

    def add(self, marks: tuple[int, ...], operands: tuple[Any, ...]) -> bool:
        """Stage the entries `marks`, whose operands are `operands` (`count` each, in order), all or
        none. False, and nothing staged, when one cannot be staged now: an operand is neither a Python
        number (not a bool) nor a 0-d `torch.Tensor` (not a subclass) of a `STAGED_DTYPES` dtype on
        the buffer's device outside autograd; or while compiling or capturing a CUDA graph (the
        update belongs in the graph); or once the stage closed. Past `limit` entries the part is
        applied at once."""
        if not self.open or _is_compiling() or (self._cuda and _capturing()):
            return False
        slots, tensors, versions = self.slots, self.tensors, self.versions
        staged_slots, staged_tensors = len(slots), len(tensors)
        for operand in operands:
            if type(operand) in _NUMBERS:
                slots += (None, operand)
            elif (
                type(operand) is _TENSOR  # not a subclass: its own dispatch decides what its ops do
                and (dtype := operand.dtype) in STAGED_DTYPES
                and not (operand.requires_grad or operand.dim())
                and (operand.is_cpu if self._cpu else operand.device == self.device)
            ):
                slots += (dtype, 0.0)
                tensors.append(operand)
                versions.append(operand._version)
            else:  # refused: this call stages nothing
                del slots[staged_slots:], tensors[staged_tensors:], versions[staged_tensors:]
                return False
        staged = self.marks
        staged.extend(marks)
        if len(staged) >= self.limit:
            self.part.flush()
        return True

    def numbers(self) -> list[Any]:
        """Every staged operand as a Python number, in order (entry i's from `i * count`): a staged
        tensor is read in its memory (`tolist`: no op), so only for CPU rows."""
        values = self.slots[1::2]
        if not self.tensors:
            return values
        tensors = iter(self.tensors)
        return [
            value if kind is None else next(tensors).tolist()
            for kind, value in zip(self.slots[0::2], values, strict=True)
        ]

    def changed(self) -> list[int]:
        """Marks of the entries whose staged tensor was modified in place since it was staged."""
        if list(map(version_of, self.tensors)) == self.versions:
            return []
        changed, tensor = [], 0
        for position, kind in enumerate(self.slots[0::2]):
            if kind is not None:
                if self.tensors[tensor]._version != self.versions[tensor]:
                    changed.append(self.marks[position // self.count])
                tensor += 1
        return changed

    def gather(self, prepare: Callable[[list[int]], Any]) -> tuple[tuple[torch.Tensor, ...], Any, Any]:
        """The staged operands as float64 columns of n entries on the device (one per operand of an
        entry), what `prepare(marks)` made of this pattern's marks (kept with its plan), and on the
        CPU the host array the columns are views of (entry i's operands from `i * count`; None on a
        device)."""
        slots, tensors = self.slots, self.tensors
        key = (tuple(self.marks), tuple(slots[0::2]))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key, prepare)
        columns, flat, host, copies, prepared = plan
        if 2 * len(tensors) != len(slots):  # numbers among them
            numbers = array.array("d", slots[1::2])
            if host is not None:  # the CPU: the tensor is this host memory
                host[:] = numbers
            else:  # one copy, from pinned memory on CUDA (the caching host allocator keeps it until done)
                staged = torch.frombuffer(numbers, dtype=_STAGED)
                flat.copy_(staged.pin_memory() if self._cuda else staged, non_blocking=True)
        groups, singles = copies
        for views, pick in groups:  # the tensors of one dtype, into their slots: one op
            torch._foreach_copy_(views, pick(tensors))
        for view, position in singles:  # the one tensor of its dtype
            view.copy_(tensors[position])
        return columns, prepared, host

    def _plan(
        self, key: tuple[tuple[int, ...], tuple[torch.dtype | None, ...]], prepare: Callable[[list[int]], Any]
    ) -> tuple[Any, ...]:
        marks, kinds = key
        flat, host, slots = self._block(len(marks))
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
        tensor = 0
        for slot, kind in enumerate(kinds):  # the staged tensors come in the order of their slots
            if kind is not None:
                views, positions = by_dtype.setdefault(kind, ([], []))
                views.append(slots[slot])
                positions.append(tensor)
                tensor += 1
        groups = [
            (views, operator.itemgetter(*positions))
            for views, positions in by_dtype.values()
            if len(views) > 1
        ]
        singles = [(views[0], positions[0]) for views, positions in by_dtype.values() if len(views) == 1]
        columns = tuple(flat.view(len(marks), self.count).unbind(1))
        plan = (columns, flat, host, (groups, singles), prepare(list(marks)))
        if len(self._plans) >= CACHED:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def _block(self, n: int) -> tuple[torch.Tensor, Any, list[torch.Tensor]]:
        """The flat float64 tensor of n entries, (on the CPU) the host array it lives in, and a 0-d
        view of every slot; made once per size."""
        found = self._blocks.get(n)
        if found is None:
            if self._cpu:
                host: Any = array.array("d", bytes(8 * self.count * n))
                flat = torch.frombuffer(host, dtype=_STAGED)
            else:
                host, flat = None, torch.zeros(self.count * n, dtype=_STAGED, device=self.device)
            found = (flat, host, list(flat.unbind(0)))
            if len(self._blocks) >= CACHED:
                del self._blocks[next(iter(self._blocks))]
            self._blocks[n] = found
        return found

    def clear(self) -> None:
        self.marks.clear()
        self.slots.clear()
        self.tensors.clear()
        self.versions.clear()


def entry_offset(shape: torch.Size, first: int, index: int | tuple[int, ...]) -> int | None:
    """The offset in a staged buffer of entry `index` of a state of `shape` whose first entry is at
    `first` (None for a slice or an index out of range: indexing the state says what is wrong)."""
    offset, stride = first, 1
    if type(index) is int and len(shape) == 1:  # an entry of a vector (a signal's per-path state)
        return offset + index % shape[0] if -shape[0] <= index < shape[0] else None
    indices = index if isinstance(index, tuple) else (index,)
    if len(indices) != len(shape):
        return None
    for position, size in zip(reversed(indices), reversed(shape), strict=True):
        if type(position) is not int or not -size <= position < size:
            return None
        offset += (position % size) * stride
        stride *= size
    return offset
