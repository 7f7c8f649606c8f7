"""Functional reductions over dicts of named values, packed like `sync_metrics`.

For values that live outside metrics (a loss, a gradient norm, a sample count): `reduce` gives
every rank the mean, sum, max or min of each value over the ranks, `reduce_custom` the same with
an op per value, `all_gather` every rank's values stacked by rank, and `per_rank` those as Python
lists. One collective per (op, dtype, device) bucket however many keys there are. With no
process group they return the local values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist

from torchtelemetry.sync._buckets import BucketLayout, ReduceOp
from torchtelemetry.sync._group import GroupLike, comm_device, group_world_size, resolve_group
from torchtelemetry.sync._reduce import reduce_buffers, verify_layout

__all__ = ["Reduction", "all_gather", "per_rank", "reduce", "reduce_custom"]

Reduction = Literal["mean", "sum", "max", "min"]
_OPS: dict[str, ReduceOp] = {
    "mean": ReduceOp.SUM,
    "sum": ReduceOp.SUM,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
}

Values = Mapping[str, "torch.Tensor | float | int"]


def _tensors(values: Values, op: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for key, value in values.items():
        try:
            # Python floats are doubles: keep them exact.
            tensor = torch.as_tensor(value, dtype=torch.float64 if type(value) is float else None).detach()
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"{op}: {key!r} must be a tensor or a number, got {type(value).__name__}"
            ) from error
        tensors[key] = tensor
    return tensors


def reduce(values: Values, op: Reduction = "mean", group: GroupLike = None) -> dict[str, torch.Tensor]:
    """Reduce every value with the same `op` ("mean", "sum", "max" or "min") across `group`."""
    return reduce_custom(values, dict.fromkeys(values, op), group)


def reduce_custom(
    values: Values, ops: Mapping[str, Reduction], group: GroupLike = None
) -> dict[str, torch.Tensor]:
    """Reduce each value with its own op, e.g. `{"loss": "mean", "samples": "sum", "grad_norm": "max"}`.

    Integer values under "mean" are averaged in float64. Returns new tensors.
    """
    missing = sorted(set(values) - set(ops))
    unknown = sorted(set(ops) - set(values))
    if missing or unknown:
        raise ValueError(
            f"reduce_custom: ops must name every value (no op for {missing}, no value for {unknown})"
        )
    bad = {key: op for key, op in ops.items() if op not in _OPS}
    if bad:
        raise ValueError(f"reduce_custom: unknown ops {bad}; use one of {sorted(_OPS)}")
    tensors = _tensors(values, "reduce_custom")
    for key, op in ops.items():
        if op == "mean" and not tensors[key].is_floating_point():
            tensors[key] = tensors[key].to(torch.float64)
    layout = BucketLayout([(key, tensors[key], _OPS[ops[key]]) for key in tensors])
    buffers = layout.pack(list(tensors.values()))
    resolved = resolve_group(group, op="reduce_custom")
    reduce_buffers(layout, buffers, resolved)
    world_size = group_world_size(resolved)
    return {
        key: reduced / world_size if ops[key] == "mean" else reduced.clone()
        for key, reduced in zip(tensors, layout.unpack(buffers), strict=True)
    }


def all_gather(values: Values, group: GroupLike = None) -> dict[str, torch.Tensor]:
    """Every rank's values, stacked: `out[key][r]` is rank r's value (one collective per dtype)."""
    tensors = _tensors(values, "all_gather")
    resolved = resolve_group(group, op="all_gather")
    if resolved is None:
        return {key: tensor.unsqueeze(0).clone() for key, tensor in tensors.items()}
    layout = BucketLayout([(key, tensor, ReduceOp.SUM) for key, tensor in tensors.items()])
    buffers = layout.pack(list(tensors.values()))
    first_device = next(iter(buffers.values())).device if buffers else None
    verify_layout(layout, resolved, comm_device(resolved, first_device))
    world_size = group_world_size(resolved)
    gathered_per_rank: list[dict] = [{} for _ in range(world_size)]
    for key in layout.buckets:
        local = buffers[key]
        gathered = local.new_empty(world_size * local.numel())
        _all_gather_flat(gathered, local, resolved)
        for rank, chunk in enumerate(gathered.chunk(world_size)):
            gathered_per_rank[rank][key] = chunk
    per_rank_values = [layout.unpack(buffers_of_rank) for buffers_of_rank in gathered_per_rank]
    return {
        key: torch.stack([rank_values[index] for rank_values in per_rank_values])
        for index, key in enumerate(tensors)
    }


def per_rank(values: Values, group: GroupLike = None) -> dict[str, list]:
    """Every rank's values as Python lists on every rank: `out[key][r]` is rank r's value."""
    return {key: stacked.tolist() for key, stacked in all_gather(values, group).items()}


def _all_gather_flat(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)
