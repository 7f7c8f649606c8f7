"""`UpdateInputs`: the prologue every built-in `update()` starts with, and the checks it shares.

One place for the rules every input meets: the thread that may update a metric, what may be
passed (tensors on the metric's device, Python numbers, numpy data; dtypes widened exactly or
refused), and `nan_policy` ("error" raises, "ignore" masks, "propagate" passes values through).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

if TYPE_CHECKING:
    from torchtelemetry.metric._accumulator import MetricAccumulator

__all__ = ["NAN_POLICIES", "READY_DTYPES", "NanPolicy", "UpdateInputs", "nonfinite_count"]

NanPolicy = Literal["error", "ignore", "propagate"]
NAN_POLICIES: tuple[str, ...] = get_args(NanPolicy)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Input dtypes that most PyTorch ops do not implement, widened exactly before any check reads them:
# every float8 value is a float32, every uint16/uint32 an int64. uint64 has no exact wider type
# (None): refused.
_WIDENED: dict[torch.dtype, torch.dtype | None] = {
    **{
        dtype: torch.float32
        for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
        if isinstance(dtype := getattr(torch, name, None), torch.dtype)
    },
    **{
        dtype: torch.int64
        for name in ("uint16", "uint32")
        if isinstance(dtype := getattr(torch, name, None), torch.dtype)
    },
    **({torch.uint64: None} if hasattr(torch, "uint64") else {}),
}
# Real dtypes every op takes as they are: a tensor of one of them on the metric's device, outside
# autograd, goes into the update unconverted.
READY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)


_INTEGRAL = frozenset(dtype for dtype in READY_DTYPES if not dtype.is_floating_point)
"""Ready dtypes no tensor of which can require a gradient."""
_TENSOR = torch.Tensor
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_is_compiling = torch.compiler.is_compiling
"""Bound once: a prologue pays one global read for each."""


def nonfinite_count(value: torch.Tensor) -> torch.Tensor:
    """The number of NaN and +-Inf entries of a floating point or complex tensor, as a 0-d tensor on
    its device (no sync), with one temporary the size of the input: `x - x` is NaN exactly where `x`
    is not finite, and `ne_` marks those in place. (`isfinite` decomposes into four kernels and
    four temporaries, one of them of the input's dtype.)"""
    if value.requires_grad:
        value = value.detach()
    if value.dtype.itemsize == 1:
        value = value.float()  # float8 has no arithmetic kernels; float32 holds it exactly
    elif value.is_complex():
        value = value.abs()  # Inf where a part is infinite, else NaN where a part is NaN
    bad = value - value
    bad.ne_(bad)
    return bad if bad.dim() == 0 else bad.sum(dtype=torch.float64)


class UpdateInputs:
    """The input side of `Metric`: `_begin_update()` is the prologue of every built-in `update()`."""

    nan_policy: NanPolicy
    _thread: int
    _thread_name: str

    if TYPE_CHECKING:

        @property
        def device(self) -> torch.device: ...

        def display_name(self) -> str: ...

    def _begin_update(
        self, value: Any, what: str = "value", device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prologue of a built-in `update()`: the thread check, then `_input(value)`."""
        if not _is_dynamo_compiling() and threading.get_ident() != self._thread:
            self._check_thread()
        return self._input(value, what, device)

    def _ready_scalars(self, value: Any, weight: Any, device: torch.device) -> bool:
        """The prologue of the common case, in one expression (a loss and its token count): a 0-d
        tensor `value` of a ready dtype outside autograd, and a `weight` that is one too or a Python
        number (int or float) >= 0, both on the metric's `device`, under nan_policy "propagate", on
        the metric's thread; a CPU weight tensor is read (not negative), as the full prologue reads
        it. True: both go into the update as they are; False: the caller runs `_begin_update`. About
        a third of the full prologue's cost (bench/README.md)."""
        kind = type(weight)
        return (
            type(value) is _TENSOR
            and not _is_dynamo_compiling()
            and threading.get_ident() == self._thread
            and self.nan_policy == "propagate"
            and value.dtype in READY_DTYPES
            and not (value.requires_grad or value.dim())
            and value.device == device
            and (
                (kind is float or (kind is int and weight <= _INT64_MAX)) and weight >= 0
                if kind is not _TENSOR
                else (
                    (
                        (dtype := weight.dtype) in _INTEGRAL
                        or (dtype in READY_DTYPES and not weight.requires_grad)
                    )
                    and not weight.dim()
                    and weight.device == device
                    and (not weight.is_cpu or weight.item() >= 0)
                )
            )
        )

    def _input(
        self, value: Any, what: str, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`value` as a tensor on the metric's device (`_as_tensor`), and `nan_policy` applied to it:
        "error" raises on NaN or Inf; "ignore" gives the mask of finite entries (else None).

        A tensor of a real dtype on the metric's device, outside autograd, is taken as it is (the
        common case: three attribute reads and no call)."""
        if not (
            isinstance(value, torch.Tensor)
            and value.dtype in READY_DTYPES
            and not value.requires_grad
            and value.device == (device or self.device)
        ):
            value = self._as_tensor(value, what, device)
        if self.nan_policy == "propagate":
            return value, None
        self._check_finite(value, what)
        return value, self._finite_mask(value)

    def _check_thread(self) -> None:
        """Raise unless called on the thread that built the metric (eager only: the caller checks
        `torch.compiler.is_dynamo_compiling()` first, so compiled code never traces the thread id)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"{self.display_name()}: update() called from thread "
                f"{threading.current_thread().name!r}, but the metric belongs to thread "
                f"{self._thread_name!r} that built it. Metrics are updated on one thread, the one "
                "that built them and calls Telemetry.step() (an update racing a collection is lost "
                "or torn); build the metric on the thread that updates it"
            )

    def _check_into_integer_state(
        self, dtype: torch.dtype, value: torch.Tensor, weight: torch.Tensor | None
    ) -> None:
        """Raise if a floating point `value` (or `weight`) would be added to a state of integer
        `dtype` (it cannot hold it)."""
        for what, tensor in (("value", value), ("weight", weight)):
            if tensor is not None and tensor.is_floating_point():
                raise TypeError(
                    f"{self.display_name()}: {what} has dtype {tensor.dtype}, but the metric's state is "
                    f"{dtype}; pass integers, or build the metric with a floating point dtype="
                )

    def _batch_sum(
        self, state: MetricAccumulator, value: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sum of `value` (times `weight`) computed in `state`'s dtype, never in the input's
        (a float16 batch of 3 x 30000 sums to 90000, not inf).

        For an integer state, a sum that would wrap the state raises a `ValueError` (checked
        where values may be read: on CPU, or under nan_policy="error"); nothing is changed.
        """
        dtype = state.dtype
        integer = not dtype.is_floating_point
        if integer:
            self._check_into_integer_state(dtype, value, weight)
        if weight is not None:
            batch = (value.to(dtype) * weight.to(dtype)).sum()
        elif value.dim() == 0:
            batch = value  # added into the state in its dtype: a 0-d operand takes the state's
        else:
            batch = value.sum(dtype=dtype)
        if integer and self._inspects_values(value):
            self._check_no_wrap(state, value, weight, batch)
        return batch

    def _check_no_wrap(
        self, state: MetricAccumulator, value: torch.Tensor, weight: torch.Tensor | None, batch: torch.Tensor
    ) -> None:
        """Raise if adding `batch` (the sum of `value` times `weight`) wraps the integer `state`.
        Python integers are exact; a wrapped batch sum is off from its float64 shadow by a
        multiple of 2**bits, far more than the shadow's rounding."""
        info = torch.iinfo(state.dtype)
        added = int(batch.item())
        if weight is not None or value.numel() > 1:
            shadow = (value.double() if weight is None else value.double() * weight.double()).sum().item()
            wrapped = abs(shadow - added) > info.max
        else:
            wrapped = False
        totals = [total + added for total in state.local.reshape(-1).tolist()]
        if wrapped or not all(info.min <= total <= info.max for total in totals):
            raise ValueError(
                f"{self.display_name()}: the total would leave the range of its state dtype {state.dtype} "
                f"[{info.min}, {info.max}]; nothing was added. Use a floating point dtype= (integers "
                "exact up to 2**53) for totals this large"
            )

    def _as_tensor(self, value: Any, what: str, device: torch.device | None = None) -> torch.Tensor:
        """Accept tensors, Python numbers and numpy scalars/arrays; put them on the metric's device.

        Python numbers become tensors by a fill on the device, never by a host-to-device copy, in
        float64 (a Python float is one: exact) or int64; numpy data and 0-d CPU tensors by a
        non-blocking copy. `device` (the metric's) saves looking it up again.
        """
        device = device or self.device
        if isinstance(value, torch.Tensor):
            return self._converted(value, what, device)
        number = type(value)
        if number is float:
            return torch.full((), value, dtype=torch.float64, device=device)
        if number is bool or (number is int and _INT64_MIN <= value <= _INT64_MAX):
            return torch.full((), value, device=device)
        if number is int:
            raise ValueError(f"{self.display_name()}: {what}={value} does not fit in a 64-bit integer")
        try:
            tensor = torch.as_tensor(value)
            if tensor.dtype == torch.get_default_dtype() and isinstance(value, (list, tuple)):
                # Python floats in a list: float64 (the default dtype would round them first)
                tensor = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"{self.display_name()}: {what} must be a tensor or a number, got {type(value).__name__}"
            ) from error
        tensor = self._widened(tensor, what) if tensor.dtype in _WIDENED else self._real(tensor, what)
        # Host data (numpy, lists): staged by a non-blocking copy, never one the host waits for.
        return tensor.to(device, non_blocking=True)

    def _converted(self, value: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
        """A tensor on `device` (a 0-d CPU tensor is moved there, any other device raises), detached
        from autograd, widened (`_widened`); complex raises."""
        if value.device != device:
            if not (value.is_cpu and value.dim() == 0):
                raise ValueError(
                    f"{self.display_name()}: {what} is on {value.device}, but the metric lives on "
                    f"{device}; move the input or call metric.to({str(value.device)!r})"
                )
            value = value.to(device, non_blocking=True)
        if value.requires_grad:
            value = value.detach()
        if value.dtype in _WIDENED:
            return self._widened(value, what)
        return self._real(value, what)

    def _widened(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """A float8 tensor as float32, a uint16/uint32 one as int64 (exact); uint64 raises."""
        dtype = _WIDENED[tensor.dtype]
        if dtype is None:
            raise TypeError(
                f"{self.display_name()}: {what} has dtype {tensor.dtype}, which no metric state holds "
                "exactly (values above 2**63 - 1 have no int64); pass .to(torch.int64) or .double()"
            )
        return tensor.to(dtype)

    def _real(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """`tensor`, unless it is complex (no metric state can hold it)."""
        if tensor.is_complex():
            raise TypeError(
                f"{self.display_name()}: {what} has complex dtype {tensor.dtype}; metrics take real "
                "numbers (pass .real or .abs())"
            )
        return tensor

    def _inspects_values(self, tensor: torch.Tensor) -> bool:
        """Whether value checks may read tensor data: never a device sync, never in a compiled graph."""
        return (self.nan_policy == "error" or tensor.is_cpu) and not _is_compiling()

    def _check_finite(self, tensor: torch.Tensor, what: str) -> None:
        """Under nan_policy="error", raise on NaN or Inf (a host sync on accelerators)."""
        if (
            self.nan_policy == "error"
            and not torch.compiler.is_compiling()
            and tensor.is_floating_point()
            and not bool(torch.isfinite(tensor).all())
        ):
            raise ValueError(
                f"{self.display_name()}: {what} contains NaN or Inf and nan_policy='error'; "
                "use nan_policy='ignore' to skip non-finite values"
            )

    def _finite_mask(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Under nan_policy="ignore", the mask of finite entries (device-side, no sync)."""
        if self.nan_policy == "ignore" and tensor.is_floating_point():
            return torch.isfinite(tensor)
        return None
