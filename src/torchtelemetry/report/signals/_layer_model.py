"""The model side of `Telemetry.watch_layers`: which layers, the parameters each holds, how many ranks
of the window's group hold an identical copy of each, and the measurement of their norms.

Each rank adds, per layer, its local sum of squares of every parameter (and gradient) divided by the
number of ranks holding an identical copy of it, so that the window's one SUM gives the full
tensor's sum of squares. A plain tensor is a copy on every rank of the group (DDP); a DTensor's
local part is held by the product of its mesh's `Replicate()` dims (a `Shard` is one rank's own
piece) times the group's copies of that mesh. A `Partial` placement is a sum still pending over
ranks: its norm needs a collective beyond the window's, so the layer is left out, and logged.
Where a NaN was born is `_layer_checks`. Nothing here reads a device value on the host, and nothing
changes a gradient or a parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchtelemetry.metric import DEFAULT_STATE_DTYPE
from torchtelemetry.report.signals._layer_checks import LayerChecks, LayerParameter, is_dtensor, local_part

__all__ = ["ROOT_LAYER", "Measurement", "WatchedLayers", "copies"]

ROOT_LAYER = "<root>"
_WEIGHT_LISTS = 8
"""Distinct weight lists kept on the device (one for gradients, one for values, as a rule)."""
"""The name of the model itself when it holds parameters of its own (a module path is never empty)."""

logger = logging.getLogger(__name__)


def copies(tensor: torch.Tensor, group_size: int) -> int | None:
    """How many ranks of the window's group (of `group_size` ranks) hold an identical copy of each entry
    of `tensor`'s local part; None when the local part is no piece of the full tensor (a `Partial`)."""
    if not is_dtensor(tensor):
        return group_size
    mesh = tensor.device_mesh
    replicas = 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_partial():
            return None
        if placement.is_replicate():
            replicas *= mesh.size(dim)
    return replicas * (group_size // mesh.size())


@dataclass(frozen=True, slots=True)
class Measurement:
    """Host facts of one measurement of the norms, by layer name."""

    layers: frozenset[str]
    """The layers measured."""
    without_gradient: frozenset[str]
    """Layers none of whose parameters had a gradient."""
    partial: frozenset[str]
    """Layers with a `Partial` parameter or gradient: left out of both norms."""


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose paths name the layers: inside DDP's and torch.compile's wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


def _check_replication(model: nn.Module, group_ranks: Sequence[int]) -> None:
    """Refuse what would make a copy count wrong: DDP over ranks the group does not cover, FSDP1."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise ValueError(
            "Telemetry.watch_layers: FullyShardedDataParallel (FSDP1) keeps each rank's shard in plain "
            "tensors, which cannot say they are shards; use fully_shard (FSDP2), whose DTensor "
            "parameters can"
        )
    if isinstance(model, DistributedDataParallel) and model.process_group is not None:
        replicated = set(dist.get_process_group_ranks(model.process_group))
        if not set(group_ranks) <= replicated:
            raise ValueError(
                f"Telemetry.watch_layers: DDP replicates the model over ranks {sorted(replicated)}, but "
                f"the window is reduced over ranks {list(group_ranks)}, which hold other copies; give "
                "the Telemetry a group within DDP's (TelemetryConfig.group)"
            )


def _check_mesh(parameter: LayerParameter, tensor: torch.Tensor, group_ranks: Sequence[int]) -> None:
    if not is_dtensor(tensor):
        return
    mesh_ranks = sorted(int(rank) for rank in tensor.device_mesh.mesh.flatten().tolist())
    if not set(mesh_ranks) <= set(group_ranks) or len(group_ranks) % len(mesh_ranks):
        raise ValueError(
            f"Telemetry.watch_layers: parameter {parameter.path!r} is a DTensor over ranks {mesh_ranks}, "
            f"which do not tile the window's group (ranks {list(group_ranks)}): its copies cannot be "
            "counted. Give the Telemetry a group made of whole copies of that mesh (TelemetryConfig.group)"
        )


def resolve_layers(model: nn.Module, paths: Sequence[str] | None) -> tuple[list[str], list[nn.Module]]:
    """The watched layers, sorted by name: those at `paths` (with every parameter under them), or with
    None each module that directly holds parameters (`ROOT_LAYER` for the model itself)."""
    root = _unwrap(model)
    modules = dict(root.named_modules())
    if paths is None:
        found = {path or ROOT_LAYER: module for path, module in modules.items() if _own(module)}
    else:
        if isinstance(paths, str):
            raise TypeError(
                f"Telemetry.watch_layers: layers must be a sequence of module paths, got {paths!r}"
            )
        unknown = [path for path in paths if path not in modules or not path]
        if unknown:
            raise ValueError(
                f"Telemetry.watch_layers: {unknown} are not module paths of the model (e.g. "
                f"{sorted(path for path in modules if path)[:5]})"
            )
        found = {path: modules[path] for path in paths}
    if not found:
        raise ValueError("Telemetry.watch_layers: the model holds no parameters")
    names = sorted(found)
    return names, [found[name] for name in names]


def _own(module: nn.Module) -> bool:
    return any(parameter is not None for parameter in module._parameters.values())


def layer_parameters(names: Sequence[str], modules: Sequence[nn.Module], whole: bool) -> list[LayerParameter]:
    """Each layer's parameters: its own (`whole` False), or every one under it."""
    found = []
    for index, (name, module) in enumerate(zip(names, modules, strict=True)):
        held = module.named_parameters() if whole else module.named_parameters(recurse=False)
        for path, _ in held:
            owner_path, _, attr = path.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            full = path if name == ROOT_LAYER else f"{name}.{path}"
            found.append(LayerParameter(index, owner, attr, full))
    return found


class WatchedLayers:
    """The layers of one `watch_layers` call: their parameters, the checks hooked into the model
    (with `nonfinite`), and the measurement of their norms (see the module)."""

    def __init__(
        self,
        model: nn.Module,
        paths: Sequence[str] | None,
        *,
        device: torch.device,
        group_ranks: Sequence[int],
        nonfinite: bool = True,
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        _check_replication(model, group_ranks)
        self.names, modules = resolve_layers(model, paths)
        self.parameters = layer_parameters(self.names, modules, whole=paths is not None)
        self._group_size = len(group_ranks)
        for parameter in self.parameters:
            tensor = parameter.current()
            if tensor is None:
                continue
            _check_mesh(parameter, tensor, group_ranks)
            held_on = local_part(tensor).device
            if held_on != device:
                raise ValueError(
                    f"Telemetry.watch_layers: parameter {parameter.path!r} is on {held_on}, but this "
                    f"Telemetry's window is on {device} (the device of its metrics): its layers' "
                    f"statistics would cross devices every step. Build the metrics on {held_on}"
                )
        self._device = device
        self._empty = torch.zeros(0, device=device)
        self._weight_tensors: dict[tuple[float, ...], torch.Tensor] = {}
        self._partial_logged: set[str] = set()
        self.layer_of = torch.tensor([p.layer for p in self.parameters], dtype=torch.long, device=device)
        """The layer of each of `parameters`."""
        swapped = any(isinstance(module, FSDPModule) for module in _unwrap(model).modules())
        self.checks = (
            LayerChecks(modules, self.parameters, self.layer_of, swapped=swapped) if nonfinite else None
        )
        """Where a NaN was born (None: not checked)."""

    def holds_any(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` steps one of the watched parameters (as they are now)."""
        current = {id(tensor) for parameter in self.parameters if (tensor := parameter.current()) is not None}
        return any(id(tensor) in current for group in optimizer.param_groups for tensor in group["params"])

    def measure(self, gradients: torch.Tensor | None, parameters: torch.Tensor | None) -> Measurement:
        """Replace `gradients` (and `parameters`), one entry per layer, by this rank's share of each
        layer's sum of squares over its parameters' gradients (and values): device ops, no sync."""
        grads: list[torch.Tensor] = []
        grad_weights: list[float] = []
        values: list[torch.Tensor] = []
        value_weights: list[float] = []
        with_gradient: set[int] = set()
        partial: set[int] = set()
        for parameter in self.parameters:
            tensor = parameter.current()
            gradient = None if tensor is None else tensor.grad
            if gradient is not None:
                with_gradient.add(parameter.layer)
            for part, weights, found in ((gradient, grad_weights, grads), (tensor, value_weights, values)):
                local, weight = self._share(part, parameter, partial)
                found.append(local)
                weights.append(weight)
        if gradients is not None:
            self._write(gradients, grads, grad_weights)
        if parameters is not None:
            self._write(parameters, values, value_weights)
        return Measurement(
            layers=frozenset(self.names),
            without_gradient=frozenset(self.names) - {self.names[index] for index in with_gradient},
            partial=frozenset(self.names[index] for index in partial),
        )

    def _share(
        self, tensor: torch.Tensor | None, parameter: LayerParameter, partial: set[int]
    ) -> tuple[torch.Tensor, float]:
        """This rank's part of `tensor` and the weight of its sum of squares (1 / its copies)."""
        if tensor is None or not tensor.is_floating_point():
            return self._empty, 0.0
        held = copies(tensor, self._group_size)
        if held is None:
            partial.add(parameter.layer)
            if parameter.path not in self._partial_logged:
                self._partial_logged.add(parameter.path)
                logger.error(
                    "Telemetry.watch_layers: %r (or its gradient) is a DTensor with a Partial placement, a "
                    "sum over ranks still pending: its norm would need a collective beyond the window's, "
                    "so layer %r is left out of train/layer/grad_norm and param_norm",
                    parameter.path,
                    self.names[parameter.layer],
                )
            return self._empty, 0.0
        return local_part(tensor), 1.0 / held

    def _write(self, state: torch.Tensor, tensors: list[torch.Tensor], weights: list[float]) -> None:
        """`state[layer]` = the sum of each tensor's squared norm times its weight, over the layer's
        tensors. Norms are accumulated in float32 (float64 for float64 tensors), one fused kernel per
        dtype on CUDA; squares, weights and sums in float64."""
        dtype = torch.float64 if any(tensor.dtype == torch.float64 for tensor in tensors) else torch.float32
        squares = torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype)).to(DEFAULT_STATE_DTYPE)
        squares.square_().mul_(self._weights(weights))
        state.zero_()
        state.index_add_(0, self.layer_of, squares)

    def _weights(self, weights: list[float]) -> torch.Tensor:
        """`weights` on the device: copied once per distinct list (a non-blocking copy), then reused."""
        key = tuple(weights)
        found = self._weight_tensors.get(key)
        if found is None:
            if len(self._weight_tensors) >= _WEIGHT_LISTS:
                self._weight_tensors.clear()
            pinned = self._device.type == "cuda"
            host = torch.tensor(weights, dtype=DEFAULT_STATE_DTYPE, pin_memory=pinned)
            found = self._weight_tensors[key] = host.to(self._device, non_blocking=True)
        return found

    def close(self) -> None:
        if self.checks is not None:
            self.checks.remove()
