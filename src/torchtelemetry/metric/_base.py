"""The `Metric` base class: accumulators registered as attributes, the rest for free."""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from torchtelemetry.metric._accumulator import MetricAccumulator
from torchtelemetry.metric._batched import BatchedRule
from torchtelemetry.metric._inputs import NAN_POLICIES, NanPolicy, UpdateInputs
from torchtelemetry.metric._shards import rank_local, rank_sharded
from torchtelemetry.sync import GroupLike

__all__ = ["DEFAULT_LABEL_NAME", "Metric", "MetricExample", "MetricKind", "NanPolicy"]

DEFAULT_LABEL_NAME = "label"
"""The label of the entries of a 1-D result whose metric names none, for every exporter."""


class MetricKind(enum.Enum):
    """How exporters present a metric's results."""

    GAUGE = "gauge"
    """A value that goes up and down (the default)."""
    COUNTER = "counter"
    """A monotonic count: exporters publish the running total across windows."""
    HISTOGRAM = "histogram"
    """Bucket counts with fixed boundaries, plus sum and count."""


class MetricExample:
    """One input form a metric documents: the metric built with `options`, then `update(*args)` for
    each `args` of `updates`. The test suites run every example of every exported metric."""

    __slots__ = ("form", "options", "updates")

    def __init__(self, form: str, *updates: tuple[Any, ...], **options: Any) -> None:
        self.form = form
        """What the example shows ("logits, top-2"): the test id."""
        self.updates = updates
        """The arguments of each `update()` call: CPU tensors, Python numbers or lists (a test moves
        the tensors to the device it runs on)."""
        self.options = options
        """The constructor's keyword arguments."""

    def __repr__(self) -> str:
        return f"MetricExample({self.form!r}, {len(self.updates)} updates, {self.options})"


class Metric(UpdateInputs):
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
    batched: ClassVar[BatchedRule | None] = None
    """A built-in's compute of K instances at once, which its `compute()` runs with K = 1."""
    label_name: str = DEFAULT_LABEL_NAME
    """Label exporters give the entries of 1-D results (e.g. "class", "rank")."""
    keyed_states: ClassVar[Mapping[str, str]] = {}
    """Accumulators whose first dim is indexed by names (a signal's phases or watched metric paths),
    by attribute: the `configuration()` key listing those names. A checkpoint restores such an
    accumulator's entries by name (`restore_local_states`), not by position."""

    def __init__(
        self,
        *,
        name: str | None = None,
        kind: MetricKind | str | None = None,
        unit: str | None = None,
        description: str = "",
        nan_policy: NanPolicy = "propagate",
    ) -> None:
        if nan_policy not in NAN_POLICIES:
            raise ValueError(
                f"{type(self).__name__}: nan_policy must be one of {NAN_POLICIES}, got {nan_policy!r}"
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
            self._accumulators_changed()
        elif accumulators.pop(attr, None) is not None:
            self._accumulators_changed()
        object.__setattr__(self, attr, value)

    def _accumulators_changed(self) -> None:
        """Tell the collector holding this metric (if any) that its accumulators were registered, replaced,
        dropped or moved; no one else."""
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

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        """The input forms the class documents, small and exact. The test suites run each through
        every promise a metric keeps (no host sync, bad input, batched compute = `compute()`,
        checkpoint round trip, torchmetrics parity); a metric that `torchtelemetry.metric` exports
        must declare some (docs/metrics.md)."""
        return ()

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Fold one batch into the local state."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def compute(self) -> Any:
        """Turn the synchronized state into a PyTree of tensors (a built-in: its `batched` rule with
        K = 1)."""
        if self.batched is None:
            raise NotImplementedError(f"{type(self).__name__} must implement compute()")
        return self.batched.compute_one(self)

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
        self._accumulators_changed()
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

    def __repr__(self) -> str:
        states = ", ".join(f"{attr}={tuple(acc.shape)}" for attr, acc in self._accumulators.items())
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind.value}, {states})"
