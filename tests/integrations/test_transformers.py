"""TrainerTelemetryCallback on a real 2-process Hugging Face Trainer run launched with torchrun."""

from __future__ import annotations

import pytest

from tests.integrations._torchrun import run_two_ranks

pytest.importorskip("transformers")

STEPS, LOGGING_STEPS = 6, 2


def test_trainer_run_exports_exact_values_from_world_process_zero_only(tmp_path) -> None:
    ranks, reports = run_two_ranks("_hf_train.py", tmp_path)

    trained = [report for report in reports if "train/token_loss" in report["values"]]
    assert [report["step"] for report in trained] == [2, 4, 6]
    assert {report["run_id"] for report in reports} == {"hf-test"}
    trainer_logs = {entry["step"]: entry for entry in ranks[0]["log_history"] if "loss" in entry}
    tokens = 0
    for index, report in enumerate(trained):
        window = [
            r for rank in ranks for r in rank["records"][index * LOGGING_STEPS : (index + 1) * LOGGING_STEPS]
        ]
        values = report["values"]
        tokens += sum(r["count"] for r in window)
        assert values["train/token_loss"] == pytest.approx(
            sum(r["sum"] for r in window) / sum(r["count"] for r in window), rel=1e-6
        )
        assert values["train/max_token_loss"] == pytest.approx(max(r["max"] for r in window), rel=1e-6)
        assert values["train/label_tokens"] == tokens
        assert values["train/learning_rate"] == pytest.approx(1e-3)
        assert "learning_rate" not in values, "one learning rate per report: the built-in signal's"
        # The Trainer's own log of this step rides in the same report, unchanged.
        logged = trainer_logs[report["step"]]
        assert values["loss"] == logged["loss"]
        assert values["grad_norm"] == pytest.approx(logged["grad_norm"])
    assert tokens == 2 * STEPS * 2 * (8 - 1)

    evaluated = [report for report in reports if "eval_loss" in report["values"]]
    assert len(evaluated) == 1
    assert evaluated[0]["step"] == STEPS
    assert evaluated[0]["values"]["eval_loss"] == ranks[0]["eval"]["eval_loss"]
