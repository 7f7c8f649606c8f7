"""WandbExporter against real W&B offline runs, read back from their `.wandb` transaction logs."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from tests.export.trackers import export_label_clashes
from tests.export.workload import STEPS, expected_values, global_report, make_metrics, update_window
from tests.receivers import WandbRunLog, find_wandb_logs, wait_for_wandb_logs
from torchtelemetry.export import (
    DrawnHistogram,
    ExportHub,
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    NullHub,
    RunInfo,
    WandbExporter,
    drawn_histogram,
)
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import describe_metrics

wandb = pytest.importorskip("wandb")

LOSS = MetricDescriptor("train/loss")
OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> Path:
    for key, value in {**OFFLINE_ENV, "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    yield tmp_path
    if wandb.run is not None:  # a failed test must not leak its run into the next one
        wandb.run.finish()
    wandb.teardown()  # W&B keeps the environment it first saw (WANDB_DIR, WANDB_MODE) until torn down


def _only_log(wandb_dir: Path) -> WandbRunLog:
    (log,) = wait_for_wandb_logs(wandb_dir, 1)
    return log


# -- 2 ranks through the hub ------------------------------------------------------------

RUN_ID = "wandb-two-ranks"


def _wandb_rank(rank: int, world_size: int) -> dict[str, int]:
    metrics = make_metrics(rank, world_size)
    exporter = WandbExporter(  # the same call on every rank; only rank 0's hub starts a run
        "torchtelemetry-tests",
        run_name="two-ranks",
        config={"lr": 0.125},
        tags=["ci"],
        summaries={"train/loss": "min", "tokens": "max"},
    )
    run = RunInfo(run_id=RUN_ID, world_size=world_size, config={"batch_size": 8})
    hub = ExportHub([exporter], run=run) if rank == 0 else NullHub()
    hub.describe(describe_metrics(metrics))
    for window, step in enumerate(STEPS):
        update_window(metrics, rank, window)
        hub.submit(step, global_report(metrics))
    hub.close(60)
    health = hub.health().get("wandb")
    return {"reports": health.exported_reports, "errors": health.errors} if health else {}


def test_two_ranks_offline_run_holds_every_step_and_value(tmp_path):
    env = {**OFFLINE_ENV, "WANDB_DIR": str(tmp_path)}
    results = run_ranks(_wandb_rank, 2, env=env, timeout_s=180)
    assert results == [{"reports": len(STEPS), "errors": 0}, {}]

    log = _only_log(tmp_path)  # rank 1 started no run
    assert (log.run_id, log.project, log.display_name, log.tags) == (
        RUN_ID,
        "torchtelemetry-tests",
        "two-ranks",
        ["ci"],
    )
    assert {key: log.config[key] for key in ("lr", "batch_size", "world_size")} == {
        "lr": 0.125,
        "batch_size": 8,
        "world_size": 2,
    }
    assert log.steps == STEPS
    losses = []
    for window, row in enumerate(log.history):
        expected = expected_values(2, window + 1)
        losses.append(expected["train/loss"])
        assert row["train/loss"] == expected["train/loss"]
        assert row["tokens"] == expected["tokens"]
        assert row["step_time/rank_0"] == expected["step_time"]["0"]
        assert row["step_time/rank_1"] == expected["step_time"]["1"]
        histogram = row["grad_norm"]
        assert histogram["_type"] == "histogram"
        now = expected["grad_norm"]["counts"]
        before = expected_values(2, window)["grad_norm"]["counts"] if window else [0] * len(now)
        # the report holds running totals; W&B gets this interval's distribution between the bounds,
        # and the open outer buckets' counts beside it (no made-up edge for them)
        counts = [a - b for a, b in zip(now, before, strict=True)]
        assert histogram["values"] == counts[1:-1]
        assert histogram["bins"] == [0.5, 1.0, 2.0]
        assert (row["grad_norm/underflow"], row["grad_norm/overflow"]) == (counts[0], counts[-1])
        assert row["exporter/exported_reports/exporter_wandb"] == window + 1  # health, counting itself
    assert log.summary["train/loss"] == {"min": min(losses)}
    assert log.summary["tokens"] == {"max": expected_values(2, len(STEPS))["tokens"]}
    assert log.metrics["train/loss"].summary.min


# -- steps ------------------------------------------------------------------------------


def test_out_of_order_steps_are_dropped_and_counted_and_a_repeated_step_merges(wandb_dir, caplog):
    exporter = WandbExporter("tt", mode="offline")
    hub = ExportHub([exporter], run=RunInfo(run_id="out-of-order"))
    hub.describe([LOSS])
    with caplog.at_level(logging.WARNING):
        for step, values in ((1, {"train/loss": 1.0}), (5, {"train/loss": 5.0}), (3, {"train/loss": 3.0}),
                             (5, {"eval/loss": 7.0}), (6, {"train/loss": 6.0})):  # fmt: skip
            hub.submit(step, values)
        hub.close(60)
    assert exporter.dropped_steps == 1
    health = hub.health()["wandb"]
    assert (health.exported_reports, health.errors) == (4, 1)
    assert "step 3 dropped" in caplog.text
    log = _only_log(wandb_dir)
    assert log.steps == [1, 5, 6]
    assert [row["train/loss"] for row in log.history] == [1.0, 5.0, 6.0]
    assert log.history[1]["eval/loss"] == 7.0, "a second report at the same step joins its row"


def test_drawn_histogram_makes_up_no_edge():
    value = HistogramValue(bounds=(0.5, 1.0, 2.0, 4.0), counts=(1.0, 2.0, 3.0, 4.0, 5.0), sum=0.0, count=15.0)
    assert drawn_histogram(value) == DrawnHistogram(
        edges=(0.5, 1.0, 2.0, 4.0), counts=(2.0, 3.0, 4.0), underflow=1.0, overflow=5.0
    )
    single = HistogramValue(bounds=(1.0,), counts=(3.0, 4.0), sum=0.0, count=7.0)
    assert drawn_histogram(single) == DrawnHistogram(edges=(1.0,), counts=(), underflow=3.0, overflow=4.0)


def test_histogram_and_label_values_are_logged_exactly(wandb_dir):
    exporter = WandbExporter("tt")
    descriptors = [
        MetricDescriptor("grad", MetricKind.HISTOGRAM),
        MetricDescriptor("train/step_time", unit="seconds", label_name="rank"),
    ]
    exporter.describe(descriptors, RunInfo(run_id="kinds"))
    value = HistogramValue(bounds=(-1.0, 0.0, 4.0), counts=(2.0, 0.0, 5.0, 1.0), sum=9.5, count=8.0)
    scalars = {"grad": value, "train/step_time": {"0": 0.5, "1": 0.75}}
    assert exporter.export(2, scalars, 0.0) is ExportResult.SUCCESS
    exporter.close()
    (row,) = _only_log(wandb_dir).history
    assert row["grad"]["values"] == [0, 5]  # (-1, 0] and (0, 4]
    assert row["grad"]["bins"] == [-1.0, 0.0, 4.0]
    assert (row["grad/underflow"], row["grad/overflow"]) == (2.0, 1.0)  # at or below -1, above 4
    assert (row["train/step_time/rank_0"], row["train/step_time/rank_1"]) == (0.5, 0.75)


def test_label_values_sanitized_into_one_key_are_left_out_counted_and_logged(wandb_dir, caplog):
    export_label_clashes(WandbExporter("tt"), caplog)
    rows = _only_log(wandb_dir).history
    assert [row.get("queue/host_a_b") for row in rows] == [1.0, None, 3.0]  # only 'a/b'
    assert (rows[0]["step_time/rank_0"], rows[0]["step_time/rank_1"]) == (0.75, 0.25)  # rank 0: the metric
    assert [row.get("train/loss") for row in rows] == [0.5, 0.25, None]  # the rest is logged


# -- run lifecycle ----------------------------------------------------------------------


def test_resuming_a_run_id_continues_its_steps(wandb_dir):
    for steps in ([1, 2], [3, 4]):
        exporter = WandbExporter("tt", run_id="resume-me")
        exporter.describe([LOSS], RunInfo(run_id="ignored-when-run_id-given"))
        for step in steps:
            assert exporter.export(step, {"train/loss": float(step)}, 0.0) is ExportResult.SUCCESS
        exporter.close()
    first, second = wait_for_wandb_logs(wandb_dir, 2)
    assert first.run_id == second.run_id == "resume-me"
    assert (first.steps, second.steps) == ([1, 2], [3, 4])


def test_mode_argument_beats_environment(wandb_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    exporter = WandbExporter("tt", mode="offline")
    exporter.describe([LOSS], RunInfo(run_id="mode-arg"))
    assert exporter.export(1, {"train/loss": 1.0}, 0.0) is ExportResult.SUCCESS
    exporter.close()
    assert _only_log(wandb_dir).steps == [1]


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_disabled_mode_writes_nothing(wandb_dir, monkeypatch, where):
    if where == "environment":
        monkeypatch.setenv("WANDB_MODE", "disabled")
    exporter = WandbExporter("tt", mode="disabled" if where == "argument" else None)
    exporter.describe([LOSS], RunInfo(run_id="disabled"))
    assert exporter.export(1, {"train/loss": 1.0}, 0.0) is ExportResult.SUCCESS
    assert exporter.force_flush()
    exporter.close()
    assert find_wandb_logs(wandb_dir) == []


def test_an_active_run_is_reused_and_left_open(wandb_dir):
    run = wandb.init(project="tt", id="users-own-run")
    try:
        exporter = WandbExporter("ignored")
        exporter.describe([LOSS], RunInfo(run_id="other"))
        assert exporter.run is run
        assert exporter.export(4, {"train/loss": 4.0}, 0.0) is ExportResult.SUCCESS
        exporter.close()
        run.log({"user/metric": 1.0}, step=5)  # still open: the user's run is not finished for them
    finally:
        run.finish()
    log = _only_log(wandb_dir)
    assert log.run_id == "users-own-run"
    assert log.steps == [4, 5]


def test_close_twice_warns_and_export_after_close_fails(wandb_dir, caplog):
    exporter = WandbExporter("tt")
    exporter.describe([LOSS], RunInfo(run_id="twice"))
    exporter.close()
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()
    assert exporter.export(1, {"train/loss": 1.0}, 0.0) is ExportResult.FAILURE
    assert exporter.run is None
    assert _only_log(wandb_dir).steps == []


def test_api_key_never_logged(wandb_dir, monkeypatch, caplog):
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    caplog.set_level(logging.DEBUG)
    exporter = WandbExporter("tt")
    exporter.describe([LOSS], RunInfo(run_id="secret"))
    exporter.export(1, {"train/loss": 1.0}, 0.0)
    exporter.close()
    assert "W&B run secret" in caplog.text
    assert secret not in caplog.text
    for path in wandb_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_constructor_starts_nothing(wandb_dir):
    exporter = WandbExporter("tt")
    assert exporter.run is None
    assert exporter.export(1, {"train/loss": 1.0}, 0.0) is ExportResult.FAILURE
    exporter.close()
    assert not any(wandb_dir.iterdir())


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be one of"):
        WandbExporter(mode="sometimes")
    with pytest.raises(ValueError, match=r"summaries\['train/loss'\]"):
        WandbExporter(summaries={"train/loss": "median"})
    with pytest.raises(ValueError, match="resume must be one of"):
        WandbExporter(resume="maybe")


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"torchtelemetry\[wandb\]"):
        WandbExporter("tt")
