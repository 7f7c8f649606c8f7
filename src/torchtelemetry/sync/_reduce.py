"""Packed buffers reduced across ranks: one collective per bucket, after the ranks agree on the layout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchtelemetry.sync._buckets import BucketKey, BucketLayout, ReduceOp
from torchtelemetry.sync._group import comm_device

__all__ = ["LayoutMismatchError", "forget_group", "reduce_buffers", "verify_layout"]

_DIST_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

# Layouts already checked to agree across the ranks of a group: {group name: {hash}}.
# Process-global: process groups (and their names) are per process in torch.distributed.
_VERIFIED_LAYOUTS: dict[str, set[int]] = {}


class LayoutMismatchError(ValueError):
    """Ranks hold different metric sets (names, shapes, dtypes or ops)."""


def reduce_buffers(
    layout: BucketLayout,
    buffers: dict[BucketKey, torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
) -> list[Any]:
    """All-reduce each packed buffer in place, one collective per bucket, in bucket order.

    The first time a layout is seen on a group, all ranks check that they agree
    on it (one small collective); a mismatch raises `LayoutMismatchError` on
    every rank instead of hanging or mixing up values. Returns the Work handles
    (empty unless `async_op`).
    """
    if group is None:
        return []
    first_device = next(iter(buffers.values())).device if buffers else None
    verify_layout(layout, group, comm_device(group, first_device))
    works = []
    for key in layout.buckets:
        work = dist.all_reduce(buffers[key], op=_DIST_OPS[key.reduce_op], group=group, async_op=async_op)
        if work is not None:
            works.append(work)
    return works


def forget_group(group: dist.ProcessGroup) -> None:
    """Drop what `verify_layout` remembers of `group` (call when destroying it)."""
    _VERIFIED_LAYOUTS.pop(group.group_name, None)


def verify_layout(layout: BucketLayout, group: dist.ProcessGroup, device: torch.device) -> None:
    """Check once per (group, layout) that every rank holds the same layout."""
    verified = _VERIFIED_LAYOUTS.setdefault(group.group_name, set())
    signature_hash = layout.signature_hash()
    if signature_hash in verified:
        return
    probe = torch.tensor([signature_hash, -signature_hash], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if probe.tolist() == [signature_hash, -signature_hash]:
        verified.add(signature_hash)
        return
    signatures: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, layout.described(), group=group)
    raise LayoutMismatchError(_describe_mismatch(signatures, dist.get_rank(group)))


def _describe_mismatch(signatures: list[tuple[list, list]], rank: int) -> str:
    """Name the states and configuration attributes that differ between rank 0 and each other rank
    (at most 5 each)."""
    entries = [dict(states) for states, _ in signatures]
    configs = [{(owner, attr): value for owner, attr, value in config} for _, config in signatures]
    reference = entries[0]
    lines = []
    for other_rank, (other, other_config) in enumerate(zip(entries[1:], configs[1:], strict=True), start=1):
        attributes = [
            f"{owner!r} has {attr}={configs[0][owner, attr]} on rank 0 but {attr}={value} "
            f"on rank {other_rank}"
            for (owner, attr), value in other_config.items()
            if (owner, attr) in configs[0] and configs[0][owner, attr] != value
        ] + [
            f"{owner!r} has {attr} on rank {'0' if (owner, attr) in configs[0] else other_rank} only"
            for owner, attr in sorted(set(configs[0]) ^ set(other_config))
        ]
        lines.extend(attributes[:5])
        only_ref = sorted(set(reference) - set(other))
        only_other = sorted(set(other) - set(reference))
        differ = [
            f"{name!r} is {reference[name]} on rank 0 but {other[name]} on rank {other_rank}"
            for name in reference
            if name in other and reference[name] != other[name]
        ]
        if only_ref or only_other:
            lines.append(f"rank {other_rank} lacks {only_ref[:5]} and has extra {only_other[:5]} vs rank 0")
        lines.extend(differ[:5])
        if not (only_ref or only_other or differ or attributes) and list(reference) != list(other):
            lines.append(f"rank {other_rank} holds the same states as rank 0 in a different order")
    return (
        f"sync_metrics (rank {rank}): ranks hold different metric sets: "
        + "; ".join(lines)
        + "; every rank must create the same metrics (same names, shapes, dtypes, ops and configuration "
        "such as bins, top_k, kind, in the same order)"
    )
