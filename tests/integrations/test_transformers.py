"""TrainerTelemetryCallback on a real 2-process Hugging Face Trainer run launched with torchrun."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations._torchrun import run_two_ranks

pytest.importorskip("transformers")

STEPS, LOGGING_STEPS = 6, 2


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What each rank of one torchrun launch of `_hf_train.py` recorded, and the reports rank 0 exported."""
    return run_two_ranks("_hf_train.py", tmp_path_factory.mktemp("hf"))


def test_trainer_run_exports_exact_values_from_world_process_zero_only(hf_run) -> None:
    ranks, reports = hf_run

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
        # The Trainer's own log of this step rides in the same report, under hf/, unchanged.
        logged = trainer_logs[report["step"]]
        assert values["hf/loss"] == logged["loss"]
        assert values["hf/loss"] == pytest.approx(values["train/token_loss"], rel=1e-5), "the true loss"
        assert values["hf/grad_norm"] == pytest.approx(logged["grad_norm"])
        assert values["hf/epoch"] == logged["epoch"]
        # The learning rate the Trainer logged for this step (a new one every step: linear decay).
        assert values["hf/learning_rate"] == logged["learning_rate"]
        assert values["train/learning_rate"] == logged["learning_rate"]
        assert set(values["train/sync_wait"]) == {"0", "1"}  # the wait in DDP's all-reduce, per rank
    assert tokens == 2 * STEPS * 2 * (8 - 1)
    assert len({entry["learning_rate"] for entry in trainer_logs.values()}) == 3

    evaluated = [report for report in reports if "hf/eval_loss" in report["values"]]
    assert len(evaluated) == 1
    assert evaluated[0]["step"] == STEPS
    assert evaluated[0]["values"]["hf/eval_loss"] == ranks[0]["eval"]["eval_loss"]


def test_the_end_of_training_summary_keeps_its_names_and_values(hf_run) -> None:
    """`train_samples_per_second` and the rest of the summary are the Trainer's, not the built-in
    `train/samples_per_second`: under hf/ they are kept whole, on every exporter."""
    ranks, reports = hf_run
    (summary,) = [entry for entry in ranks[0]["log_history"] if "train_runtime" in entry]
    names = {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
    }
    assert names <= set(summary)
    (report,) = [report for report in reports if "hf/train_runtime" in report["values"]]
    assert {name: report["values"][f"hf/{name}"] for name in names} == {name: summary[name] for name in names}
    assert ranks[0]["errors"]["prometheus"] == 0, "no name collides in the Prometheus exposition"
    scraped = ranks[0]["scraped"]
    for name in ("hf_train_samples_per_second", "hf_loss", "hf_learning_rate", "train_learning_rate"):
        assert f"torchtelemetry_{name}{{" in scraped, name
