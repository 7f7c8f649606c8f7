"""TelemetryTracker in a real 2-process accelerate run launched with torchrun."""

from __future__ import annotations

import pytest

from tests.integrations._torchrun import run_two_ranks

pytest.importorskip("accelerate")

STEPS, EVERY = 6, 2


def test_tracker_exports_each_value_once_from_the_main_process(tmp_path) -> None:
    ranks, reports = run_two_ranks("_accelerate_train.py", tmp_path)

    # One report per step, in step order: accelerator.log at every step, and the collection of
    # every second step in the same report as that step's log.
    assert [report["step"] for report in reports] == list(range(1, STEPS + 1))
    for report in reports:
        step, values = report["step"], report["values"]
        assert values["main_loss"] == ranks[0]["losses"][step - 1]
        assert "note" not in values
        collected = "train/loss" in values
        assert collected == (step % EVERY == 0)
        if collected:
            window = [loss for rank in ranks for loss in rank["losses"][step - EVERY : step]]
            assert values["train/loss"] == pytest.approx(sum(window) / len(window), rel=1e-6)
            assert values["train/examples"] == 2 * 2 * step
    assert {report["run_id"] for report in reports} == {reports[0]["run_id"]}
