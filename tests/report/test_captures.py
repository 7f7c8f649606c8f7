"""The captures' side of a window: the order and outcomes survive the window's SUM across ranks
exactly, and the verdicts are read from what the other signals derived (docs/signals.md, Captures)."""

from __future__ import annotations

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.report import CaptureOrder, CaptureOutcomes, CaptureWindow, Verdict, check_capture_reason
from torchtelemetry.report.signals._captures import CaptureSlots, window_verdicts

COUNTS = {"straggler": 1, "nonfinite": 0, "hang": 2, "request": 3}


def _reduced(*parts: CaptureWindow) -> CaptureWindow:
    """What every rank reads once each rank wrote its part and the window's SUM added them up."""
    total = torch.zeros_like(CaptureSlots().slots.local)
    for part in parts:
        slots = CaptureSlots()
        slots.write(part)
        total += slots.slots.local
    return CaptureSlots.read({str(index): value for index, value in enumerate(total.tolist())})


@pytest.mark.parametrize(
    "order",
    [
        CaptureOrder(1023, 7, "straggler", "straggler"),
        CaptureOrder(0, None, "nonfinite", "nonfinite"),
        CaptureOrder(5, None, "request", "request"),
        CaptureOrder(0, None, "request", "slow_checkpoint_" + "x" * 16),
    ],
)
def test_the_exporting_ranks_order_and_every_ranks_outcomes_survive_the_sum(order: CaptureOrder) -> None:
    exporting = CaptureWindow(order, COUNTS, (3, 1_000_000), CaptureOutcomes(0, 1, 0))
    others = [
        CaptureWindow(outcomes=CaptureOutcomes(1, 1, 1)),
        CaptureWindow(outcomes=CaptureOutcomes(1, 0, 0)),
    ]
    assert _reduced(exporting, *others) == CaptureWindow(
        order, COUNTS, (3, 1_000_000), CaptureOutcomes(2, 2, 1)
    )


def test_a_window_without_captures_carries_nothing() -> None:
    assert _reduced(CaptureWindow(), CaptureWindow()) == CaptureWindow(None, dict.fromkeys(COUNTS, 0))


def test_a_straggler_is_captured_beside_the_median_rank_of_the_phase_it_is_named_in() -> None:
    window = {
        "train/straggler/top_rank": {"1": 5.0, "2": 1.0},
        "train/straggler/rank": {"forward": 5.0, "data": 1.0, "optimizer": 5.0},
        "train/straggler/score": {"forward": 9.0, "data": 3.0, "optimizer": 1.5},
        "train/phases/median_rank": {"forward": 2.0, "data": 3.0, "optimizer": 0.0},
    }
    assert window_verdicts(window, step=10) == [Verdict("straggler", 5, 2), Verdict("straggler", 1, 3)]


def test_a_straggler_that_is_nowhere_the_slowest_takes_the_top_scored_phase_and_never_itself() -> None:
    window = {
        "train/straggler/top_rank": {"1": 4.0},
        "train/straggler/rank": {"forward": 6.0},
        "train/straggler/score": {"forward": 9.0, "backward": 2.0},
        "train/phases/median_rank": {"forward": 4.0, "backward": 1.0},
    }
    assert window_verdicts(window, step=10) == [Verdict("straggler", 4, None)]  # forward's median: itself


def test_the_first_non_finite_rank_is_a_verdict_in_the_window_that_saw_it_only() -> None:
    window = {
        "train/nonfinite/first_rank": {"train/loss": 3.0, "val/loss": 1.0},
        "train/nonfinite/first_step": {"train/loss": 19.0, "val/loss": 9.0},
    }
    assert window_verdicts(window, step=19) == [Verdict("nonfinite", 3)]
    assert window_verdicts(window, step=29) == []  # kept since (and across restarts): not new


@pytest.mark.parametrize(
    ("reason", "error"),
    [
        ("", "1 to 32 of a-z"),
        ("Slow", "1 to 32 of a-z"),
        ("../x", "1 to 32 of a-z"),
        ("x" * 33, "1 to 32 of a-z"),
        ("straggler", "one of the library's own"),
        ("reference", "one of the library's own"),
        ("failed", "one of the library's own"),
    ],
)
def test_a_request_reason_that_could_not_name_a_directory_of_its_own_is_refused(
    reason: str, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        check_capture_reason(reason)


def test_request_capture_refuses_a_rank_outside_the_group_and_works_only_where_captures_are_on() -> None:
    with tt.Telemetry({"loss": tt.SumMetric()}, every=2, nvml=False) as telemetry:
        for rank in (1, -1, True, "0"):
            with pytest.raises(ValueError, match=r"rank must be a rank of the group \(0 to 0\)"):
                telemetry.request_capture(rank)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="telemetry is closed"):
        telemetry.request_capture(0)
    with tt.Telemetry({"loss": tt.SumMetric()}, every=2, nvml=False, capture_on=()) as off:
        with pytest.raises(RuntimeError, match=r"captures are off \(capture_on=\(\)"):
            off.request_capture(0)
        assert not any(name.startswith("train/capture/") for name in (d.name for d in off.descriptors))


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"capture_on": "straggler"}, "capture_on must be a sequence of"),
        ({"capture_on": ("stragglers",)}, "capture_on must be a sequence of"),
        ({"capture_steps": 0}, "capture_steps must be an integer of at least 1"),
        ({"max_captures": 0}, "max_captures must be an integer of at least 1"),
        ({"max_captures": 1.5}, "max_captures must be an integer of at least 1"),
    ],
)
def test_capture_settings_are_checked_naming_the_key(fields: dict, error: str) -> None:
    with pytest.raises(ValueError, match=f"TelemetryConfig.{error}"):
        tt.TelemetryConfig(**fields)
