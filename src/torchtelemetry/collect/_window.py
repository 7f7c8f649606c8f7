"""One collection of a PyTree of metrics: packed by class, computed in batches, read back in one go.

`WindowPlan` lays the states out so that the K instances of a built-in class with the same state
shapes sit side by side in their bucket: each state of the class is then a `(K, *shape)` view of
the reduced buffer, and the class computes all K at once (`torchtelemetry.metric.batched_rule`).
Custom metrics compute through their own `compute()`. Every result lands in one flat int64
tensor (floats stored as their float64 bits), which becomes Python values with one `tolist()` per
part and is unflattened into each metric's results. A window's tensor ops do not grow with the
number of built-in metrics. Each rank's step rides along in a world-sized slot vector, so ranks
that reduce different windows raise instead of mixing them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtelemetry.collect._custom import reading_twin, twin_on
from torchtelemetry.collect._results import STEPS_POSITION, Packed, ResultPlacement, Results, place
from torchtelemetry.metric import (
    BatchedRule,
    Metric,
    MetricAccumulator,
    ReduceOp,
    batched_rule,
    same_identity,
    state_identity,
)
from torchtelemetry.sync import BucketKey, BucketLayout

__all__ = ["STEPS_ENTRY", "WindowMismatchError", "WindowPlan"]

STEPS_ENTRY = "<window>.steps"
"""The layout entry in which each rank writes its step (its own slot of a world-sized vector)."""
VIEWS_KEPT = 8
"""Sets of buffers whose views a plan keeps (a window's buffers are those of a ring slot, the same
each time the slot comes round: a few sets)."""


class WindowMismatchError(RuntimeError):
    """Ranks reduced windows that end at different steps."""


@dataclass(frozen=True, slots=True)
class _Block:
    """One state of a batched group: the K instances' states, contiguous in one bucket."""

    attr: str
    bucket: int
    """The bucket's index in the layout's buckets."""
    start: int
    end: int
    shape: tuple[int, ...]
    """`(K, *state shape)`."""


@dataclass(frozen=True, slots=True)
class _Views:
    """What a window computes from, as views of one set of buffers: each group's states by
    attribute, each custom metric's states, the ranks' steps (a row of one)."""

    buffers: tuple[torch.Tensor, ...]
    """The buffers, held so that their ids, the cache's key, stay theirs."""
    groups: list[dict[str, torch.Tensor]]
    custom: list[torch.Tensor]
    steps: torch.Tensor
    step_of: dict[int, torch.Tensor] = field(default_factory=dict)
    """Each rank's slot of `steps` that was written, by rank (0-d views)."""


@dataclass(slots=True)
class _Group:
    rule: BatchedRule
    positions: list[int]
    metrics: list[Metric]
    blocks: list[_Block] = field(default_factory=list)
    constants: dict[torch.device, Any] = field(default_factory=dict)

    def constants_on(self, device: torch.device) -> Any:
        if device not in self.constants:
            self.constants[device] = self.rule.constants(self.metrics, device)
        return self.constants[device]


class WindowPlan:
    """The packed layout and the batched compute of one PyTree's metrics, for a world of `world_size`."""

    def __init__(self, named: list[tuple[str, Metric]], world_size: int) -> None:
        self.named = named
        devices = {acc.device for _, metric in named for acc in metric.accumulators.values()}
        if len(devices) > 1:
            raise RuntimeError(
                f"metrics live on several devices {sorted(map(str, devices))}; "
                "move them to one device with metric.to(device) first"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        groups: dict[Any, _Group] = {}
        self._custom: list[tuple[int, Metric]] = []
        for position, (_, metric) in enumerate(named):
            rule = batched_rule(metric)
            if rule is None:
                self._custom.append((position, metric))
                continue
            key = (
                type(metric),
                tuple((a, acc.reduce_op, acc.dtype, acc.shape) for a, acc in metric.accumulators.items()),
            )
            group = groups.setdefault(key, _Group(rule, [], []))
            group.positions.append(position)
            group.metrics.append(metric)
        self._groups = list(groups.values())
        entries: list[tuple[str, MetricAccumulator]] = []
        starts: list[tuple[_Group, str, int]] = []
        for group in self._groups:
            for attr in group.metrics[0].accumulators:
                starts.append((group, attr, len(entries)))
                entries.extend(
                    (f"{named[p][0]}.{attr}", m.accumulators[attr])
                    for p, m in zip(group.positions, group.metrics, strict=True)
                )
        self._custom_from = len(entries)
        """The first layout entry of a custom metric (theirs come last, before the steps)."""
        self._custom_states = [tuple(metric.accumulators.items()) for _, metric in self._custom]
        """Each custom metric's accumulators by attribute, as laid out: what its twin reads a window
        through, even if the metric holds other accumulators by the time the window computes."""
        for (position, _), states in zip(self._custom, self._custom_states, strict=True):
            entries.extend((f"{named[position][0]}.{attr}", acc) for attr, acc in states)
        self._custom_layout = (
            BucketLayout([(name, acc.local, acc.reduce_op) for name, acc in entries[self._custom_from :]])
            if self._custom
            else None
        )
        """Where `custom_states` packs the custom metrics' states apart."""
        self.accumulators: tuple[MetricAccumulator, ...] = tuple(acc for _, acc in entries)
        sum_dtypes = {acc.dtype for acc in self.accumulators if acc.reduce_op is ReduceOp.SUM}
        steps_dtype = (
            torch.int64 if torch.int64 in sum_dtypes and torch.float64 not in sum_dtypes else torch.float64
        )
        self._steps = torch.zeros(world_size, dtype=steps_dtype, device=self.device)
        self.layout = BucketLayout(
            [(name, acc.local, acc.reduce_op) for name, acc in entries]
            + [(STEPS_ENTRY, self._steps, ReduceOp.SUM)],
            {name: metric.configuration() for name, metric in named},
        )
        self._bucket_keys = self.layout.buckets
        for group, attr, first in starts:
            bucket, start, end, shape = self._place_of(first, len(group.metrics))
            group.blocks.append(_Block(attr, bucket, start, end, shape))
        self._steps_entry = self._place_of(len(entries))
        """Where the ranks' steps lie in a window's buffers."""
        self.world_size = world_size
        self._state_identity = state_identity(self._registered())
        self._custom_on: dict[torch.device, list[tuple[int, Metric]]] = {}
        self._custom_entries = [self._place_of(index) for index in range(self._custom_from, len(entries))]
        """Where each custom metric's state lies in a window's buffers."""
        self._views: dict[tuple[int, ...], _Views] = {}
        """The views of each set of buffers computed from (by the buffers' ids), made once."""
        self._views_lock = threading.Lock()
        self._packed_last: dict[str, Packed] = {}
        """The last packed results of each kind (`compute`'s with and without the custom metrics,
        `compute_custom`'s): their placement, and on the CPU their flat tensor, reused while the
        results look alike."""

    def _place_of(self, index: int, count: int | None = None) -> tuple[int, int, int, tuple[int, ...]]:
        """Where layout entry `index` lies (with `count`: it and the `count - 1` entries of its shape
        after it): the bucket's index in `_bucket_keys`, the start and end offsets, and the shape
        (`(count, *shape)` with `count`)."""
        key, start = self.layout.offset(index)
        shape = self.layout.shape(index)
        if count is None:
            return self._bucket_keys.index(key), start, start + math.prod(shape), shape
        return self._bucket_keys.index(key), start, start + count * math.prod(shape), (count, *shape)

    def _views_of(self, buffers: dict[BucketKey, torch.Tensor]) -> _Views:
        """The views a window of `buffers` computes from, made the first time these buffers come (a
        view is an op, and a window's buffers are a ring slot's: the same every time it comes round)."""
        tensors = tuple(buffers[key] for key in self._bucket_keys)  # each key's hash is a Python call
        found = self._views.get(key := tuple(map(id, tensors)))
        if found is None:
            with self._views_lock:  # the device transport's two threads may both come here first
                found = self._views.get(key) or self._new_views(key, tensors)
        return found

    def _new_views(self, key: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> _Views:
        steps, start, end, _ = self._steps_entry
        made = _Views(
            tensors,
            [
                {
                    block.attr: tensors[block.bucket][block.start : block.end].view(block.shape)
                    for block in group.blocks
                }
                for group in self._groups
            ],
            [tensors[bucket][begin:end].view(shape) for bucket, begin, end, shape in self._custom_entries],
            tensors[steps][start:end].unsqueeze(0),
        )
        if len(self._views) >= VIEWS_KEPT:
            del self._views[next(iter(self._views))]
        self._views[key] = made
        return made

    def _registered(self) -> list[MetricAccumulator]:
        return [acc for _, metric in self.named for acc in metric.accumulators.values()]

    def unchanged(self) -> bool:
        """Whether every metric still holds the accumulators (and local tensors) this plan was built on."""
        return same_identity(self._state_identity, state_identity(self._registered()))

    def prepare(self, device: torch.device) -> None:
        """Make now (blocking is fine: at bind) what computing on `device` needs from the metrics:
        batched constants (histogram bounds) and custom metrics' tensor attributes on `device`."""
        for group in self._groups:
            group.constants_on(device)
        prepared = []
        for position, metric in self._custom:
            try:
                prepared.append((position, twin_on(metric, device)))
            except RuntimeError as error:
                raise RuntimeError(
                    f"{self.named[position][0]}: {type(metric).__name__}'s tensor attributes cannot be "
                    f"copied to {device}, where its compute() runs ({error})"
                ) from error
        self._custom_on[device] = prepared

    def local_tensors(self) -> list[torch.Tensor]:
        """Each entry's local state, in layout entry order (the steps entry: zeros)."""
        return [acc.local for acc in self.accumulators] + [self._steps]

    def initial_tensors(self) -> list[torch.Tensor]:
        """Each entry's initial state, in layout entry order."""
        return [acc.initial for acc in self.accumulators] + [self._steps]

    def write_step(self, buffers: dict[BucketKey, torch.Tensor], rank: int, step: int) -> None:
        """Put this rank's `step` in its slot of the packed steps vector."""
        views = self._views_of(buffers)
        if rank not in views.step_of:
            views.step_of[rank] = views.steps[0, rank]
        views.step_of[rank].fill_(step)

    def compute(
        self, buffers: dict[BucketKey, torch.Tensor], *, custom: bool = True
    ) -> tuple[torch.Tensor, ResultPlacement]:
        """Every metric's results from the reduced `buffers`, as one flat int64 tensor on their device.

        With `custom=False` the custom metrics are left out (see `custom_states`): what is computed
        then has the same ops and result shapes every window, and reads no value on the host."""
        results = Results()
        views = self._views_of(buffers)
        device = views.steps.device
        for group, states in zip(self._groups, views.groups, strict=True):
            constants = group.constants[device] if device in group.constants else group.constants_on(device)
            results.add(group.positions, group.rule.compute(states, constants), len(group.metrics))
        if custom and self._custom:
            self._compute_custom(results, views.custom, device)
        results.add([STEPS_POSITION], views.steps, 1)
        return self._packed(results, "all" if custom else "built-in")

    def _packed(self, results: Results, kind: str) -> tuple[torch.Tensor, ResultPlacement]:
        packed = self._packed_last[kind] = results.packed(self._packed_last.get(kind))
        return packed.flat, packed.placement

    def custom_states(self, buffers: dict[BucketKey, torch.Tensor]) -> dict[BucketKey, torch.Tensor]:
        """The custom metrics' states in the reduced `buffers`, packed into one new buffer per
        dtype (shapes fixed at bind), for `compute_custom` elsewhere: a custom `compute()` may read
        values on the host (`.item()`) or change its results' shape, so the device transport runs
        it on the worker, on the host, instead of on the training thread. Empty without custom
        metrics."""
        if self._custom_layout is None:
            return {}
        return self._custom_layout.storage(self._views_of(buffers).custom)

    def custom_states_like(self, *, pin_memory: bool) -> dict[BucketKey, torch.Tensor]:
        """Host buffers shaped as `custom_states` returns them (allocated once, at bind)."""
        if self._custom_layout is None:
            return {}
        packed = self._custom_layout.storage(self.local_tensors()[self._custom_from : -1])
        return {
            key: torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=pin_memory)
            for key, buffer in packed.items()
        }

    def compute_custom(self, states: dict[BucketKey, torch.Tensor]) -> tuple[torch.Tensor, ResultPlacement]:
        """The custom metrics' results from `custom_states` (copied anywhere, e.g. to the host)."""
        results = Results()
        if self._custom_layout is not None:
            device = next(iter(states.values())).device
            self._compute_custom(results, self._custom_layout.views(states), device)
        return self._packed(results, "custom")

    def _compute_custom(self, results: Results, views: list[torch.Tensor], device: torch.device) -> None:
        if device not in self._custom_on:
            self.prepare(device)
        read = iter(views)
        for (position, metric), states in zip(self._custom_on[device], self._custom_states, strict=True):
            try:
                computed = reading_twin(
                    metric, {attr: acc.reading(next(read)) for attr, acc in states}
                ).compute()
            except RuntimeError as error:
                raise RuntimeError(
                    f"{self.named[position][0]}: {type(metric).__name__}.compute() failed on the window's "
                    f"state on {device} ({error}); compute() must read its state through each "
                    "accumulator's `value` and work on that device (keep tensor constants there too)"
                ) from error
            results.add([position], computed, 1, unbatched=True)

    def results(
        self,
        flat: torch.Tensor,
        placement: ResultPlacement,
        custom: tuple[torch.Tensor, ResultPlacement] | None = None,
    ) -> list[Any]:
        """Each metric's results as Python values (host `flat` from `compute`), in `named` order;
        `custom`: the custom metrics' (`compute_custom`) if `compute` left them out.

        Raises `WindowMismatchError` if the ranks' steps differ."""
        out: list[Any] = [None] * len(self.named)
        packed = tuple(self._packed_last.values())  # at once: another thread may pack meanwhile
        for part_flat, part in (flat, placement), *(() if custom is None else (custom,)):
            parts = next((p.parts for p in packed if p.flat is part_flat), None)
            steps = place(out, part_flat, part, parts)
            if steps is not None:
                self._check_steps(steps)
        return out

    @staticmethod
    def _check_steps(steps: list[float | int]) -> None:
        if len(set(steps)) > 1:
            per_rank = ", ".join(f"rank {rank} at step {int(step)}" for rank, step in enumerate(steps))
            raise WindowMismatchError(
                f"ranks collected different windows ({per_rank}); every rank must schedule a collection "
                "at the same steps (call Telemetry.step() / schedule_collection() the same way on every rank)"
            )
