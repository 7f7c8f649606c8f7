"""Every signal's state is keyed by name, never by position (issue 30.4): ranks that declare the same
phases or watched metrics in another order merge by name, ranks that declare different ones raise a
`LayoutMismatchError` naming the signal and the ranks, and a checkpoint restores by name (a name
missing on either side is logged)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import RankFailed, run_ranks
from tests.report.windows import collect_window, context
from torchtelemetry.metric import gather_local_states, metric_leaves, restore_local_states
from torchtelemetry.report.signals import NonFiniteSentinel, Phases, SignalSet, watched_metrics
from torchtelemetry.report.signals._phases import PhaseTimes

NAN = float("nan")


class _SecondsClock:
    """A phase clock whose every section of phase `name` lasts `seconds[name]` (no wall clock)."""

    def __init__(self, declared: tuple[str, ...], seconds: dict[str, float]) -> None:
        self._per_section = [seconds[name] for name in declared]
        self._taken = [0.0] * len(declared)

    def start(self) -> None:
        return None

    def stop(self, index: int, started: None) -> None:
        self._taken[index] += self._per_section[index]

    def entered_at(self, started: None) -> float:
        return 0.0

    def take(
        self, steps: int, *, wait: bool = False, timeout_s: float = 60.0
    ) -> list[tuple[list[float], int]]:
        taken, self._taken = self._taken, [0.0] * len(self._taken)
        return [(taken, steps)]

    def close(self) -> None:
        """Nothing to release."""


# Rank 1 is slow in its forward; it declares its phases in the other order (a set's order follows
# PYTHONHASHSEED, so ranks may well do so).
SECONDS = [{"forward": 1.0, "backward": 2.0}, {"forward": 3.0, "backward": 4.0}]


def _phases_declared(rank: int, world_size: int, orders: list[tuple[str, ...]]) -> dict[str, Any]:
    declared = orders[rank]
    clock = _SecondsClock(
        declared, SECONDS[rank] | {name: 1.0 for name in declared if name not in SECONDS[rank]}
    )
    phases = Phases(context(world_size, rank), declared, clock=clock)
    signals = SignalSet([phases])
    for step in range(2):
        for name in declared:
            with phases.timers()[name]:
                pass
        signals.record_step(step, None, {})
    return collect_window(signals, step=1, steps=2, duration_s=100.0)


@pytest.mark.timeout(120)
def test_ranks_that_declare_the_same_phases_in_another_order_merge_them_by_name() -> None:
    window = run_ranks(_phases_declared, 2, [("forward", "backward"), ("backward", "forward")])[0]
    assert window["train/phase/forward"] == {"0": 1.0, "1": 3.0}
    assert window["train/phase/backward"] == {"0": 2.0, "1": 4.0}
    # "backward" holds the gradient collective and no wait is measured: no straggler named there.
    assert window["train/straggler/rank"] == {"forward": 1.0}
    assert window["train/phases/max_rank"] == {"forward": 1.0, "backward": 1.0}


@pytest.mark.timeout(120)
def test_ranks_that_declare_other_phases_raise_naming_the_signal_and_the_ranks() -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_phases_declared, 2, [("forward", "backward"), ("forward", "optimizer")])
    for rank in (0, 1):
        message = failed.value.errors[rank]
        assert "LayoutMismatchError" in message
        assert (
            "'train/phase' has phases=['backward', 'forward'] on rank 0 but "
            "phases=['forward', 'optimizer'] on rank 1" in message
        )


def _nan_counts(rank: int, world_size: int, orders: list[list[str]]) -> dict[str, Any]:
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}, "val": {"loss": tt.WeightedMeanMetric()}}
    sentinel = NonFiniteSentinel(
        context(world_size, rank), watched_metrics(metric_leaves(metrics), orders[rank])
    )
    signals = SignalSet([sentinel])
    fed = metrics["train"]["loss"] if rank == 0 else metrics["val"]["loss"]
    fed.update(torch.full((2 if rank == 0 else 5,), NAN))
    window = collect_window(signals, step=3)
    sentinel.close()
    return window


@pytest.mark.timeout(120)
def test_ranks_that_watch_the_same_metrics_in_another_order_count_them_by_name() -> None:
    window = run_ranks(_nan_counts, 2, [["train/loss", "val/loss"], ["val/loss", "train/loss"]])[0]
    assert window["train/nonfinite/count"] == {"train/loss": 2.0, "val/loss": 5.0}
    assert window["train/nonfinite/first_rank"] == {"train/loss": 0.0, "val/loss": 1.0}


@pytest.mark.timeout(120)
def test_ranks_that_watch_other_metrics_raise_naming_the_signal_and_the_ranks() -> None:
    metrics_by_rank = [["train/loss"], ["val/loss"]]
    with pytest.raises(RankFailed) as failed:
        run_ranks(_nan_counts, 2, metrics_by_rank)
    for rank in (0, 1):
        assert (
            "'train/nonfinite/window' has paths=['train/loss'] on rank 0 but paths=['val/loss'] on rank 1"
            in failed.value.errors[rank]
        )


def _sentinel_run(nonfinite: list[str]) -> tuple[tt.Telemetry, dict[str, Any]]:
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}, "val": {"loss": tt.WeightedMeanMetric()}}
    telemetry = tt.Telemetry(metrics, every=100, run_id="names", nonfinite=nonfinite, phases=())
    return telemetry, metrics


def test_a_checkpoint_restores_non_finite_counts_by_metric_path(caplog: pytest.LogCaptureFixture) -> None:
    first, metrics = _sentinel_run(["train/loss", "val/loss"])
    metrics["val"]["loss"].update(torch.full((3,), NAN))  # 3 NaN of val/loss in the partial window
    metrics["train"]["loss"].update(torch.tensor(1.0))
    first.step(0)
    state = first.state_dict()
    first.close()

    reordered, _ = _sentinel_run(["val/loss", "train/loss"])
    reordered.load_state_dict(state)
    reordered.flush()
    assert reordered.latest["train/nonfinite/count"] == {"train/loss": 0.0, "val/loss": 3.0}
    reordered.close()

    with caplog.at_level(logging.WARNING, logger="torchtelemetry"):
        fewer, _ = _sentinel_run(["val/loss"])
        fewer.load_state_dict(state)
        fewer.flush()
    assert fewer.latest["train/nonfinite/count"] == {"val/loss": 3.0}
    fewer.close()
    assert any(
        "'train/nonfinite/window'" in record.getMessage()
        and "['train/loss'] is left out" in record.getMessage()
        for record in caplog.records
    ), [record.getMessage() for record in caplog.records]


def test_a_checkpoint_restores_phase_times_by_phase_name(caplog: pytest.LogCaptureFixture) -> None:
    saved = PhaseTimes(1, 0, ("forward", "backward", "optimizer"))
    saved.add([1.0, 2.0, 4.0], 1)  # in declared order
    payload = gather_local_states([("train/phase", saved)])
    restored = PhaseTimes(1, 0, ("optimizer", "forward", "checkpoint"))
    with caplog.at_level(logging.WARNING, logger="torchtelemetry"):
        restore_local_states([("train/phase", restored)], payload)
    per_step = {name: value.item() for name, value in restored.compute().items()}
    assert per_step == {"checkpoint": 0.0, "forward": 1.0, "optimizer": 4.0}
    (message,) = [record.getMessage() for record in caplog.records]
    assert "'train/phase' was saved with phases" in message
    assert "['backward'] is left out" in message and "['checkpoint'] start empty" in message
