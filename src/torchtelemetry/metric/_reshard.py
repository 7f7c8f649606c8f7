"""Metric states that survive a restart at another world size: every rank's local state, gathered.

`gather_local_states` packs every rank's local state into one payload identical on every rank
(one all-gather per dtype), small enough to checkpoint as one opaque entry, so that
`torch.distributed.checkpoint` never compares a per-rank shape with the new world size.
`restore_local_states` deals the saved ranks' states out to the new ranks: rank `r` of `n` takes
saved ranks `r, r + n, r + 2n, ...`, combined by each accumulator's reduce op. Sums, maxima and
minima are associative, so the next collection over the new ranks gives exactly the value the
old ranks would have: 4 -> 2 ranks merges pairs, 2 -> 4 leaves ranks 2 and 3 empty.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from torchtelemetry.metric._accumulator import MetricAccumulator
from torchtelemetry.metric._base import Metric
from torchtelemetry.sync import GroupLike, ReduceOp, all_gather, group_rank, group_world_size, resolve_group

__all__ = ["gather_local_states", "restore_local_states"]

logger = logging.getLogger(__name__)

_COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


def gather_local_states(metrics: Sequence[tuple[str, Metric]], group: GroupLike = None) -> bytes:
    """Every rank's local state of every metric, as one payload (the same bytes' content on every
    rank). Collective over `group`: every rank calls it."""
    resolved = resolve_group(group, op="gather_local_states")
    values = {
        f"{name}\0{attr}": accumulator.local
        for name, metric in metrics
        for attr, accumulator in metric.accumulators.items()
    }
    gathered = all_gather(values, resolved) if values else {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, stacked in gathered.items():
        name, attr = key.split("\0")
        states.setdefault(name, {})[attr] = stacked.cpu()
    configs = {name: metric.configuration() for name, metric in metrics}
    buffer = io.BytesIO()
    torch.save({"world_size": group_world_size(resolved), "states": states, "configs": configs}, buffer)
    return buffer.getvalue()


def restore_local_states(
    metrics: Sequence[tuple[str, Metric]],
    payload: bytes,
    group: GroupLike = None,
    *,
    droppable: Collection[str] = (),
) -> None:
    """Load `gather_local_states`' payload into this rank's metrics, at any world size.

    Every metric must be in the payload, except those in `droppable` (built-in ones a checkpoint
    may lack), with the configuration it was saved with (`Metric.configuration()`: the same bins,
    top_k, kind, ...), else a `ValueError` names it. A saved metric the tree no longer has is left
    out with a logged warning naming it. A state whose shape depends on the world size (a
    `PerRankMetric`) cannot move to another world size: if it holds anything, a metric in
    `droppable` loses it with a logged warning, any other raises a `ValueError` saying so. Nothing
    is changed unless every metric fits.
    """
    saved = torch.load(io.BytesIO(payload), weights_only=True)
    resolved = resolve_group(group, op="restore_local_states")
    old_world, new_world, rank = saved["world_size"], group_world_size(resolved), group_rank(resolved)
    missing = sorted(name for name, _ in metrics if name not in saved["states"] and name not in droppable)
    if missing:
        raise ValueError(f"restore_local_states: no saved state for metrics {missing}")
    configs = saved.get("configs", {})
    for name, metric in metrics:
        if metric.keyed_states and name in saved["states"]:
            aligned = _by_name(name, metric, saved["states"][name], configs.get(name))
            if aligned is None:
                del saved["states"][name]
                continue
            saved["states"][name], configs[name] = aligned
        _check_configuration(name, metric, configs.get(name))
    removed = sorted(set(saved["states"]) - {name for name, _ in metrics})
    restored: list[tuple[Metric, dict[str, torch.Tensor]]] = []
    dropped: list[str] = []
    for name, metric in metrics:
        states = saved["states"].get(name)
        if states is None:
            continue
        accumulators = metric.accumulators
        if sorted(states) != sorted(accumulators):
            raise ValueError(
                f"restore_local_states: saved state of {name!r} has entries {sorted(states)}, "
                f"the metric has {sorted(accumulators)}"
            )
        reshaped = [attr for attr, acc in accumulators.items() if states[attr].shape[1:] != acc.shape]
        if reshaped and old_world == new_world:
            raise ValueError(
                f"restore_local_states: saved state of {name!r} has shape "
                f"{tuple(states[reshaped[0]].shape[1:])} for {reshaped[0]!r}, the metric "
                f"{tuple(accumulators[reshaped[0]].shape)}"
            )
        if reshaped:
            if all(_untouched(states[attr], acc) for attr, acc in accumulators.items()):
                continue  # nothing accumulated: nothing to carry over
            if name not in droppable:
                raise ValueError(
                    f"restore_local_states: {name!r} has a state shaped by the world size "
                    f"({type(metric).__name__}); its partial window cannot be carried over from "
                    f"{old_world} to {new_world} ranks. Restart at {old_world} ranks, or call "
                    "Telemetry.flush() before saving so that no partial window is left"
                )
            dropped.append(name)
            continue
        restored.append(
            (metric, {attr: _deal(states[attr], acc, rank, new_world) for attr, acc in accumulators.items()})
        )
    for metric, local in restored:
        metric.load_state_dict(local)
    if removed:
        logger.warning(
            "restore_local_states: the checkpoint holds metrics %s that are not in the tree any more; "
            "their partial window is left out",
            removed,
        )
    if dropped:
        logger.warning(
            "restart at %d ranks from a checkpoint of %d ranks: the partial window of %s is dropped "
            "(its state is shaped by the world size); every other metric keeps it",
            new_world,
            old_world,
            dropped,
        )


def _by_name(
    name: str, metric: Metric, states: dict[str, torch.Tensor], saved: Mapping[str, Any] | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The saved ranks' `states` of `metric` with the entries of its `keyed_states` moved from the
    saved names' positions to this metric's (a name saved but not declared now is left out, one
    declared now but not saved starts empty, each with a logged warning), and the saved
    configuration with this metric's names. None (with a warning) if the checkpoint has no names."""
    current = metric.configuration()
    keys = set(metric.keyed_states.values())
    if saved is None or not keys <= saved.keys():
        logger.warning(
            "restore_local_states: %r was saved without the names of its entries (%s); its partial "
            "window is left out",
            name,
            sorted(keys),
        )
        return None
    aligned = dict(states)
    accumulators = metric.accumulators
    for attr, key in metric.keyed_states.items():
        saved_names, names = list(saved[key]), list(current[key])
        if saved_names == names or attr not in states:
            continue
        stacked, initial = states[attr], accumulators[attr].initial
        fill = initial.reshape(-1)[0].item() if initial.numel() else 0  # uniform: zeros, or +-inf
        moved = torch.full((stacked.shape[0], len(names), *stacked.shape[2:]), fill, dtype=stacked.dtype)
        for index, entry in enumerate(names):
            if entry in saved_names:
                moved[:, index] = stacked[:, saved_names.index(entry)]
        aligned[attr] = moved
    for key in sorted(keys):
        dropped = sorted(set(saved[key]) - set(current[key]))
        started = sorted(set(current[key]) - set(saved[key]))
        if dropped or started:
            logger.warning(
                "restore_local_states: %r was saved with %s %s, restored by name: the partial window "
                "of %s is left out (not declared now), %s start empty (not in the checkpoint)",
                name,
                key,
                list(saved[key]),
                dropped,
                started,
            )
    return aligned, {**saved, **{key: current[key] for key in keys}}


def _check_configuration(name: str, metric: Metric, saved: Mapping[str, Any] | None) -> None:
    """Raise unless `metric` has the configuration its state was saved with (None: a checkpoint
    from before configurations were saved, nothing to compare)."""
    if saved is None:
        return
    current = metric.configuration()
    differ = [
        f"{attr}={saved.get(attr)!r} saved, {attr}={current.get(attr)!r} now"
        for attr in sorted(set(saved) | set(current))
        if saved.get(attr) != current.get(attr)
    ]
    if differ:
        raise ValueError(
            f"restore_local_states: {name!r} was saved with another configuration ({'; '.join(differ)}); "
            "its counts would be read under the new meaning. Build it as it was saved, or give it a "
            "new name to start it afresh (the saved one is then left out with a warning)"
        )


def _untouched(stacked: torch.Tensor, accumulator: MetricAccumulator) -> bool:
    """Whether every saved rank's state is the initial one (a uniform fill, e.g. zeros, whatever
    the world size it was shaped by)."""
    initial = accumulator.initial.cpu().reshape(-1)
    if initial.numel() == 0 or not bool((initial == initial[0]).all()):
        return False
    return bool((stacked == initial[0]).all())


def _deal(stacked: torch.Tensor, accumulator: MetricAccumulator, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of the saved ranks' states: saved ranks rank, rank + world_size, ...
    combined by the accumulator's reduce op (the initial state when there are none)."""
    combined = accumulator.initial.cpu()
    for saved_rank in range(rank, stacked.shape[0], world_size):
        combined = _COMBINE[accumulator.reduce_op](combined, stacked[saved_rank])
    return combined.to(accumulator.dtype)
