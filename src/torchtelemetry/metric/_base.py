"""The `Metric` base class: accumulators registered as attributes, the rest for free."""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import Any, Literal

import torch

from torchtelemetry.metric._accumulator import MetricAccumulator, rank_local, rank_sharded
from torchtelemetry.sync import GroupLike

__all__ = ["Metric", "MetricKind", "NanPolicy"]

NanPolicy = Literal["error", "ignore", "propagate"]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NAN_POLICIES = ("error", "ignore", "propagate")
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


class MetricKind(enum.Enum):
    """How exporters present a metric's results."""

    GAUGE = "gauge"
    """A value that goes up and down (the default)."""
    COUNTER = "counter"
    """A monotonic count: exporters publish the running total across windows."""
    HISTOGRAM = "histogram"
    """Bucket counts with fixed boundaries, plus sum and count."""


class Metric:
    """Base class of all metrics.

    Subclasses assign `MetricAccumulator`s as attributes in `__init__` (they are
    registered the way `nn.Module` registers parameters), and implement
    `update()` (in-place tensor ops only: no host sync, no collective) and
    `compute()` (a PyTree of tensors read from each accumulator's `value`).
    `sync`, `reset`, `to`, `state_dict` and `load_state_dict` come for free;
    the state dict makes a metric a `torch.distributed.checkpoint` `Stateful`.

    Threads: a metric is updated on the thread that built it (or unpickled or copied it: the
    training thread, which also snapshots it at collection time). The built-ins raise a `RuntimeError` naming
    this rule when `update()` is called from another thread, instead of losing or tearing
    updates; a lock would cost every update more than the check does.
    """

    kind: MetricKind = MetricKind.GAUGE
    """How exporters present the results; built-ins set it per class or per instance."""
    unit: str = ""
    """Unit of the results ("seconds", "bytes", "ratio", ...); exporters add it to names."""
    label_name: str = "index"
    """Label exporters give the entries of 1-D results (e.g. "class", "rank")."""

    def __init__(
        self,
        *,
        name: str | None = None,
        kind: MetricKind | str | None = None,
        unit: str | None = None,
        description: str = "",
        nan_policy: NanPolicy = "propagate",
    ) -> None:
        if nan_policy not in _NAN_POLICIES:
            raise ValueError(
                f"{type(self).__name__}: nan_policy must be one of {_NAN_POLICIES}, got {nan_policy!r}"
            )
        self.__dict__.setdefault("_accumulators", {})
        self.name = name
        if kind is not None:
            self.kind = MetricKind(kind)
        if unit is not None:
            self.unit = unit
        self.description = description
        self.nan_policy: NanPolicy = nan_policy
        self._thread = threading.get_ident()
        self._thread_name = threading.current_thread().name

    def __setattr__(self, attr: str, value: Any) -> None:
        accumulators = self.__dict__.setdefault("_accumulators", {})
        if isinstance(value, MetricAccumulator):
            accumulators[attr] = value
            self._layout_changed()
        elif accumulators.pop(attr, None) is not None:
            self._layout_changed()
        object.__setattr__(self, attr, value)

    def _layout_changed(self) -> None:
        """Tell the collector holding this metric (if any) that its accumulators changed; no one else."""
        binding = self.__dict__.get("_binding")
        if binding is not None:
            binding.stale = True

    def __getstate__(self) -> dict[str, Any]:
        """A copied or unpickled metric is collected nowhere (a collector claims it at bind())."""
        return {attr: value for attr, value in self.__dict__.items() if attr != "_binding"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled or copied: the metric belongs to the thread (and process) doing it."""
        self.__dict__.update(state)
        self.__dict__["_thread"] = threading.get_ident()
        self.__dict__["_thread_name"] = threading.current_thread().name

    # -- what subclasses implement ------------------------------------------------

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold one batch into the local state."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def compute(self) -> Any:
        """Turn the synchronized state into a PyTree of tensors."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute()")

    # -- what comes for free ----------------------------------------------------

    @property
    def accumulators(self) -> dict[str, MetricAccumulator]:
        """The registered accumulators, in assignment order."""
        return dict(self._accumulators)

    @property
    def device(self) -> torch.device:
        for accumulator in self._accumulators.values():
            return accumulator.device
        return torch.device("cpu")

    def configuration(self) -> dict[str, Any]:
        """What gives the state its meaning besides its shapes and dtypes (histogram bins, top_k,
        counter or gauge, ...). Every rank must hold the same (checked with the layout at the first
        sync) and a checkpoint loads only into the same. A subclass with such attributes adds them
        to its parent's."""
        return {"kind": self.kind.value}

    def display_name(self) -> str:
        """The name used in error messages: the given name, else the class name."""
        return f"{type(self).__name__} {self.name!r}" if self.name else type(self).__name__

    def sync(self, group: GroupLike = None) -> None:
        """Reduce every accumulator across `group` (one collective per bucket)."""
        from torchtelemetry.metric._sync import sync_metrics  # _sync imports this module

        sync_metrics(self, group=group)

    def reset(self) -> None:
        """Restore every accumulator's initial state in place."""
        for accumulator in self._accumulators.values():
            accumulator.reset()

    def to(self, device: torch.device | str) -> Metric:
        """Move accumulators and tensor constants to `device`."""
        for attr, value in list(self.__dict__.items()):
            if isinstance(value, MetricAccumulator):
                value.to(device)
            elif isinstance(value, torch.Tensor):
                object.__setattr__(self, attr, value.to(device))
        self._layout_changed()
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The local state of every accumulator, by attribute name.

        Under a process group each entry is this rank's shard of a per-rank DTensor, so
        `torch.distributed.checkpoint` keeps every rank's state (see `rank_sharded`); it loads
        at the same world size only (`Telemetry.state_dict()` loads at any).
        """
        return {attr: rank_sharded(acc.local.detach().clone()) for attr, acc in self._accumulators.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a `state_dict()`; nothing is changed unless every entry fits."""
        expected = set(self._accumulators)
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"{self.display_name()}: load_state_dict keys do not match "
                f"(missing: {missing}, unexpected: {unexpected})"
            )
        restored = {}
        for attr, accumulator in self._accumulators.items():
            saved = rank_local(state_dict[attr], self.display_name())
            if saved.shape != accumulator.shape:
                raise ValueError(
                    f"{self.display_name()}: load_state_dict entry {attr!r} has shape "
                    f"{tuple(saved.shape)}, expected {tuple(accumulator.shape)}"
                )
            restored[attr] = saved
        for attr, accumulator in self._accumulators.items():
            accumulator.load_state_dict({"local": restored[attr]}, owner=self.display_name())

    # -- input checks shared by the built-ins ---------------------------------------

    def _check_thread(self) -> None:
        """Raise unless called on the thread that built the metric (eager only: the caller checks
        `torch.compiler.is_compiling()` first, so compiled code never traces the thread id)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                f"{self.display_name()}: update() called from thread "
                f"{threading.current_thread().name!r}, but the metric belongs to thread "
                f"{self._thread_name!r} that built it. Metrics are updated on one thread, the one "
                "that built them and calls Telemetry.step() (an update racing a collection is lost "
                "or torn); build the metric on the thread that updates it"
            )

    def _check_into_state(self, tensor: torch.Tensor, state: MetricAccumulator, what: str) -> None:
        """Raise if floating point `tensor` would be added to an integer state (it cannot hold it)."""
        if tensor.is_floating_point() and not state.dtype.is_floating_point:
            raise TypeError(
                f"{self.display_name()}: {what} has dtype {tensor.dtype}, but the metric's state is "
                f"{state.dtype}; pass integers, or build the metric with a floating point dtype="
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
        self._check_into_state(value, state, "value")
        if weight is not None:
            self._check_into_state(weight, state, "weight")
        if weight is not None:
            batch = (value.to(dtype) * weight.to(dtype)).sum()
        elif value.dim() == 0:
            batch = value  # added into the state in its dtype: a 0-d operand takes the state's
        else:
            batch = value.sum(dtype=dtype)
        if not dtype.is_floating_point and self._inspects_values(value):
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

        Python numbers become tensors by a fill on the device, never by a host-to-device copy;
        numpy data and 0-d CPU tensors by a non-blocking copy. `device` (the metric's) saves
        looking it up again.
        """
        device = device or self.device
        if isinstance(value, torch.Tensor):
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
            return self._real(value, what) if value.is_complex() else value
        if type(value) in (float, bool) or (type(value) is int and _INT64_MIN <= value <= _INT64_MAX):
            return torch.full((), value, device=device)
        if type(value) is int:
            raise ValueError(f"{self.display_name()}: {what}={value} does not fit in a 64-bit integer")
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"{self.display_name()}: {what} must be a tensor or a number, got {type(value).__name__}"
            ) from error
        tensor = self._widened(tensor, what) if tensor.dtype in _WIDENED else self._real(tensor, what)
        # Host data (numpy): staged by a non-blocking copy, never one the host waits for.
        return tensor.to(device, non_blocking=True)

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
        if torch.compiler.is_compiling():
            return False
        return self.nan_policy == "error" or tensor.is_cpu

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

    def __repr__(self) -> str:
        states = ", ".join(f"{attr}={tuple(acc.shape)}" for attr, acc in self._accumulators.items())
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind.value}, {states})"
