"""A host-sync detector that runs without a GPU: `NoHostSync` fails on every call that would make
the host wait for a CUDA device, in the thread that enters it.

Two modes see every torch call of the thread (both are per thread, so a collector's worker is
not checked):

- a `TorchFunctionMode` sees the Python-level calls that read a value into Python or copy
  host data to a device synchronously: `Tensor.item()`, `.tolist()`, `.numpy()`, `.cpu()`,
  `bool()` / `float()` / `int()` / `format()` of a tensor, and `torch.tensor` / `torch.as_tensor` /
  `torch.asarray` of Python or numpy data onto a device (a blocking host-to-device copy);
- a `TorchDispatchMode` sees the aten ops: `_local_scalar_dense` (every `.item()`), `is_nonzero`,
  `equal`, `allclose`, ops whose output shape depends on the data (`nonzero`, `masked_select`,
  `unique`, boolean indexing, `repeat_interleave` without `output_size`, `bincount`), copies from
  a device to the host (unless non-blocking into pinned memory), and blocking copies from the
  host to a device.

Run the code under test on the "meta" device (a device without data; no GPU needed) to check its
device path: the metrics treat every device but the CPU alike, so on "meta" they take the path
they take on CUDA, and every op the detector flags there would sync a GPU. Code that cannot run
without data (a collector's window) runs on CPU tensors instead: then every read of a value
counts, device or not, except inside the functions given as `exempt`, the CPU-only checks that
read values by design (input validation the metrics skip on a device).

What it cannot see: waits outside torch's Python API (`torch.cuda.synchronize()`,
`Event.synchronize()`, `Stream.synchronize()`, a `Work.wait()`, `queue.get()` or any Python wait),
implicit synchronization inside the CUDA driver (`cudaHostAlloc` / `cudaFree` in the allocators),
and the cost of what it allows (a non-blocking copy from pageable memory still stages the bytes
on the host). `torch.cuda.set_sync_debug_mode("error")` on a GPU sees the driver-level syncs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import CodeType, TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from tests.ops import TorchDispatchMode
from torchtelemetry.metric._aggregation import _any_negative
from torchtelemetry.metric._inputs import UpdateInputs
from torchtelemetry.metric._staged_rows import StagedRows

__all__ = ["CPU_ONLY_READS", "HostSyncError", "NoHostSync"]

CPU_ONLY_READS = (_any_negative, UpdateInputs._ready_scalars, StagedRows.numbers)
"""The library's reads of values that run on the CPU only, by design (a device skips them): the
counters' check for negative values, the check of Python-ready scalars, and a staged flush applied
in host memory. `NoHostSync(exempt=CPU_ONLY_READS)` on CPU tensors checks everything else."""

_READS = {
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "__repr__",
    "__array__",
}
"""Python-level calls that bring a tensor's values to the host."""

_CONSTRUCTORS = {"tensor", "as_tensor", "asarray"}
"""`torch.<name>(data, device=...)`: data not already a tensor is copied to `device` synchronously."""

_SYNCING_OPS = {
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.equal",
    "aten.allclose",
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
}
"""aten ops (by overload packet) that read a value or size their output from the data."""


class HostSyncError(AssertionError):
    """Code under `NoHostSync` would have made the host wait for the device."""


def _is_device(tensor: Any) -> bool:
    """Any device but the host ("meta" stands in for CUDA)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat = [*args, *(kwargs or {}).values()]
    nested = [item for value in flat if isinstance(value, (list, tuple)) for item in value]
    return [value for value in (*flat, *nested) if isinstance(value, torch.Tensor)]


class _Functions(TorchFunctionMode):
    def __init__(self, owner: NoHostSync) -> None:
        super().__init__()
        self._owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in _READS:
            self._owner.found(f"{name}() of a tensor", _tensors(args, kwargs))
        elif name in _CONSTRUCTORS and args and not isinstance(args[0], torch.Tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                self._owner.found(f"torch.{func.__name__}(host data, device={device!r}): a blocking copy", [])
        return func(*args, **kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, owner: NoHostSync) -> None:
        super().__init__()
        self._owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        tensors = _tensors(args, kwargs)
        if name in _SYNCING_OPS:
            self._owner.found(name, tensors)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            index is not None and index.dtype in (torch.bool, torch.uint8) for index in _indices(args)
        ):
            self._owner.found(f"{name} with a boolean mask (its output size is the mask's count)", tensors)
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self._owner.found(f"{name} without output_size", tensors)
        elif name in ("aten._to_copy", "aten.copy_", "aten._copy_from"):
            self._check_copy(name, args, kwargs)
        return func(*args, **kwargs)

    def _check_copy(self, name: str, args: Any, kwargs: Any) -> None:
        non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        if name == "aten._to_copy":
            source = args[0]
            target_device = torch.device(kwargs.get("device") or source.device)
            target_pinned = bool(kwargs.get("pin_memory"))
        else:
            target, source = (args[0], args[1]) if name == "aten.copy_" else (args[1], args[0])
            target_device, target_pinned = target.device, target.device.type == "cpu" and _pinned(target)
        if _is_device(source) and target_device.type == "cpu" and not (non_blocking and target_pinned):
            self._owner.found(f"{name}: a device-to-host copy that the host waits for", [source])
        elif source.device.type == "cpu" and target_device.type != "cpu" and not non_blocking:
            self._owner.found(f"{name}: a blocking host-to-device copy", [source])


def _indices(args: Any) -> list[torch.Tensor]:
    return [index for index in (args[1] if len(args) > 1 else ()) if isinstance(index, torch.Tensor)]


def _pinned(tensor: torch.Tensor) -> bool:
    try:
        return tensor.is_pinned()
    except RuntimeError:  # a fake tensor
        return False


class NoHostSync:
    """`with NoHostSync():` raise `HostSyncError` at the first call that would sync a CUDA device.

    `exempt`: functions inside which reads of CPU tensors are allowed (CPU-only checks by design).
    `found` lists everything seen (all of it, if `collect=True`, instead of raising at the first).
    """

    def __init__(self, *, exempt: Iterable[Callable[..., Any]] = (), collect: bool = False) -> None:
        self._exempt: set[CodeType] = {function.__code__ for function in exempt}
        self._collect = collect
        self.seen: list[str] = []
        self._modes = (_Functions(self), _Ops(self))

    def found(self, what: str, tensors: list[torch.Tensor]) -> None:
        if self._exempt and all(t.device.type == "cpu" for t in tensors) and self._in_exempt():
            return
        where = _caller()
        self.seen.append(f"{what} at {where}")
        if not self._collect:
            raise HostSyncError(f"host sync: {what} at {where}")

    def _in_exempt(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in self._exempt:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def __enter__(self) -> NoHostSync:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(kind, error, trace)


def _caller() -> str:
    """The innermost frame of torchtelemetry's or the tests' code (not torch's, not this module's)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if ("torchtelemetry" in filename or "/tests/" in filename) and not filename.endswith("hostsync.py"):
            return f"{filename.rsplit('/', 2)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"
