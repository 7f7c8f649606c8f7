"""Where a NaN was born: device-side checks of each watched layer's output and gradients.

A forward hook takes each watched layer's output, and a hook on each of its parameters the gradient
as it is accumulated (the rank's own gradient, before DDP's all-reduce or FSDP's reduce-scatter), and
keeps the tensor's smallest and largest entry (`aminmax(out=)`: one kernel, no temporary, in the
tensor's dtype) in a probe of one slot per layer and per parameter: an entry is NaN or +-Inf
exactly when one of the two is. Once per step `fold()` turns the probe into each layer's first
non-finite step, O(1) kernels; nothing reads a device value on the host, and no hook changes a
gradient or an output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from torchtelemetry.metric import DEFAULT_STATE_DTYPE

__all__ = ["LayerChecks", "LayerParameter", "is_dtensor", "local_part"]


def _dtensor_type() -> type | None:
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


_DTENSOR = _dtensor_type()


def is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTENSOR is not None and isinstance(tensor, _DTENSOR)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`, detached (a DTensor's local tensor: no communication)."""
    if is_dtensor(tensor):
        tensor = tensor.to_local()
    return tensor.detach()


@dataclass(frozen=True, slots=True)
class LayerParameter:
    """One parameter of a watched layer: held by `owner` as `attr` (read there when needed, as FSDP
    swaps the object between its sharded and unsharded forms)."""

    layer: int
    owner: nn.Module
    attr: str
    path: str
    """Its path in the model, for messages."""

    def current(self) -> torch.Tensor | None:
        return self.owner._parameters.get(self.attr)


class _Extremes:
    """One step's smallest and largest entry of each probe slot, for tensors of one dtype."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.low = torch.zeros(size, dtype=dtype, device=device)
        self.high = torch.zeros(size, dtype=dtype, device=device)
        self._lows, self._highs = list(self.low.unbind(0)), list(self.high.unbind(0))
        self.written = bytearray(size)
        self.any = False

    def take(self, slot: int, tensor: torch.Tensor) -> None:
        """Fold `tensor`'s extremes into `slot` (one kernel the first time in a step, three after)."""
        low, high = self._lows[slot], self._highs[slot]
        if self.written[slot]:
            found = torch.aminmax(tensor)
            torch.minimum(low, found.min, out=low)  # NaN propagates
            torch.maximum(high, found.max, out=high)
        else:
            torch.aminmax(tensor, out=(low, high))
            self.written[slot] = 1
            self.any = True

    def flag_into(self, flags: torch.Tensor) -> None:
        """Make `flags` NaN where a slot met a NaN or Inf (`x * 0` is NaN exactly then); start over."""
        flags.add_(self.low.mul(0)).add_(self.high.mul(0))
        self.low.zero_()
        self.high.zero_()
        self.written = bytearray(len(self.written))
        self.any = False


class LayerChecks:
    """Device-side checks of every watched layer's output (forward hook) and of its parameters'
    gradients (as each is accumulated) into a probe of one slot per layer and per parameter (see the
    module); `layer_of[i]` is the layer of `parameters[i]`. `swapped`: the model's modules swap
    their parameters (FSDP2), so the hooks follow each owner's current ones before its forward.
    `fold()` once per step; `remove()` takes every hook out."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        parameters: Sequence[LayerParameter],
        layer_of: torch.Tensor,
        *,
        swapped: bool,
    ) -> None:
        self._layers = len(modules)
        self._size = self._layers + len(parameters)
        self._device = device = layer_of.device
        self._layer_of = layer_of
        self._extremes: dict[torch.dtype, _Extremes] = {}
        """The probe, by the dtype of the tensors checked (each takes its own: no cast, no copy)."""
        self._flags = torch.zeros(self._size, dtype=DEFAULT_STATE_DTYPE, device=device)
        self._per_layer = torch.zeros(2, self._layers, dtype=DEFAULT_STATE_DTYPE, device=device)
        self._codes = torch.zeros(2, self._layers, dtype=DEFAULT_STATE_DTYPE, device=device)
        self.forward_order: dict[int, int] = {}
        """Layer index -> place in the order the layers' outputs were first checked."""
        self.backward_order: dict[int, int] = {}
        """Layer index -> place in the order the layers' gradients were first checked."""
        self._slots_of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """Parameter object -> its probe slots (a parameter two layers hold has two)."""
        self._handles: list[Any] = []
        for index, module in enumerate(modules):
            self._handles.append(module.register_forward_hook(self._output_check(index)))
        for slot, parameter in enumerate(parameters, start=self._layers):
            tensor = parameter.current()
            if not (swapped and tensor is not None and is_dtensor(tensor)):
                # (FSDP2 runs a sharded parameter's hooks on the gradient reduce-scattered over ranks)
                self._hook_gradient(tensor, slot, parameter.layer)
        if swapped:  # FSDP2 computes with unsharded parameters it swaps in before a forward: hook those
            owned: dict[int, list[tuple[int, LayerParameter]]] = {}
            for slot, parameter in enumerate(parameters, start=self._layers):
                owned.setdefault(id(parameter.owner), []).append((slot, parameter))
            for held in owned.values():
                self._handles.append(held[0][1].owner.register_forward_pre_hook(self._hook_current(held)))

    def _output_check(self, layer: int) -> Callable[..., None]:
        def check(module: nn.Module, args: Any, output: Any) -> None:
            if layer not in self.forward_order:
                self.forward_order[layer] = len(self.forward_order)
            if isinstance(output, torch.Tensor):
                self._probe(layer, output)
                return
            for leaf in pytree.tree_leaves(output):
                if isinstance(leaf, torch.Tensor):
                    self._probe(layer, leaf)

        return check

    def _hook_current(self, held: list[tuple[int, LayerParameter]]) -> Callable[..., None]:
        """A forward pre-hook for the owner of `held` (probe slot, parameter): hook its current ones."""

        def hook(module: nn.Module, args: Any) -> None:
            for slot, parameter in held:
                self._hook_gradient(parameter.current(), slot, parameter.layer)

        return hook

    def _hook_gradient(self, tensor: torch.Tensor | None, slot: int, layer: int) -> None:
        if tensor is None or not tensor.requires_grad:
            return
        slots = self._slots_of.get(tensor)
        if slots is None:
            slots = self._slots_of[tensor] = []
            self._handles.append(tensor.register_post_accumulate_grad_hook(self._gradient_check(slots)))
        if (slot, layer) not in slots:
            slots.append((slot, layer))

    def _gradient_check(self, slots: list[tuple[int, int]]) -> Callable[[torch.Tensor], None]:
        def check(parameter: torch.Tensor) -> None:
            gradient = parameter.grad
            if gradient is None:
                return
            for slot, layer in slots:
                if layer not in self.backward_order:
                    self.backward_order[layer] = len(self.backward_order)
                self._probe(slot, gradient)

        return check

    def _probe(self, slot: int, tensor: torch.Tensor) -> None:
        """Keep `tensor`'s extremes in probe slot `slot`."""
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return
        local = local_part(tensor)
        if local.numel() == 0:  # an empty shard (aminmax takes no empty tensor)
            return
        if local.is_complex():
            local = torch.view_as_real(local)
        elif local.dtype.itemsize == 1:
            local = local.float()  # float8 has no reductions
        extremes = self._extremes.get(local.dtype)
        if extremes is None:
            extremes = self._extremes[local.dtype] = _Extremes(self._size, local.dtype, self._device)
        extremes.take(slot, local)

    def fold(self, code: float, first: torch.Tensor) -> None:
        """Fold this step's probe into `first` (layers x (forward, backward), MIN): `code` where a
        layer's output or one of its gradients was non-finite; then start the next step's probe."""
        taken = [extremes for extremes in self._extremes.values() if extremes.any]
        if not taken:
            return
        flags, layers, per_layer = self._flags, self._layers, self._per_layer
        flags.zero_()
        for extremes in taken:
            extremes.flag_into(flags)
        per_layer[0].copy_(flags[:layers])
        per_layer[1].zero_()
        per_layer[1].index_add_(0, self._layer_of, flags[layers:])
        self._codes.fill_(code)
        self._codes.masked_fill_(per_layer == 0, float("inf"))
        torch.minimum(first, self._codes.T, out=first)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
