"""What a run's checkpoint holds besides its steps: every rank's partial window (gathered, so that it
loads at any world size), the running totals of counters and histograms, the signals' state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchtelemetry.metric import Metric, gather_local_states, restore_local_states
from torchtelemetry.report._totals import RunningTotals
from torchtelemetry.report.signals import SignalSet
from torchtelemetry.sync import GroupLike

__all__ = ["restore_run_state", "run_state"]


def run_state(
    leaves: Sequence[tuple[str, Metric]],
    totals: RunningTotals,
    signals: SignalSet | None,
    group: GroupLike,
) -> dict[str, Any]:
    """The partial window of every metric of `leaves` on every rank (collective over `group`), the
    totals (one JSON string: a fresh run cannot know which counters the saved run had) and the
    signals' state."""
    return {
        "window": gather_local_states(leaves, group),
        "counters": totals.state_dict(),
        "signals": signals.state_dict() if signals else {},
    }


def restore_run_state(
    state: Mapping[str, Any],
    leaves: Sequence[tuple[str, Metric]],
    user_leaves: Sequence[tuple[str, Metric]],
    totals: RunningTotals,
    signals: SignalSet | None,
    group: GroupLike,
) -> None:
    """Restore a `run_state()`, also one saved at another world size (see `restore_local_states`);
    metrics of `leaves` not in `user_leaves` (the built-in signals) may be missing from it."""
    if "window" not in state:
        raise ValueError(
            f"Telemetry.load_state_dict: the state has no 'window' entry (keys: {sorted(state)}); "
            "it was not written by Telemetry.state_dict() of this version, which gathers every "
            "rank's partial window so that it loads at any world size"
        )
    signal_names = {name for name, _ in leaves} - {name for name, _ in user_leaves}
    restore_local_states(leaves, state["window"], group, droppable=signal_names)
    totals.load_state_dict(state.get("counters", "{}"))
    if signals is not None:
        signals.load_state_dict(state.get("signals", {}))
