"""The `Telemetry` façade on real gloo ranks, exporting through a real JSONL file."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.step_inputs import step_inputs

EVERY = 3
STEPS = 10  # windows end at steps 2, 5, 8; close() exports the partial window ending at 9


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _loss_value(rank: int, step: int) -> float:
    return float(rank + 1) * 0.5 + step


def _train_two_ranks(rank: int, world_size: int, path: str) -> dict[str, Any]:
    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "seen": tt.SumMetric(kind="counter"),
            "worst": tt.MaxMetric(),
        }
    }
    telemetry = tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=EVERY, run_id="run-a")
    for step in range(STEPS):
        metrics["train"]["loss"].update(torch.tensor([_loss_value(rank, step)]), torch.tensor([rank + 1.0]))
        metrics["train"]["seen"].update(torch.tensor(2.0 + rank))
        metrics["train"]["worst"].update(torch.tensor(float(step * (rank + 1))))
        telemetry.step(
            step,
            **step_inputs(tokens=torch.tensor(10 * (rank + 1)), samples=rank + 1, learning_rate=0.1 * step),
        )
    telemetry.close()
    return {"latest": telemetry.latest, "exporting": telemetry.is_exporting}


def _expected_windows(world_size: int) -> dict[int, dict[str, float]]:
    windows = [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    expected, seen_total, tokens_total = {}, 0.0, 0.0
    for steps in windows:
        weighted = sum(_loss_value(r, s) * (r + 1) for r in range(world_size) for s in steps)
        weight = sum((r + 1) for r in range(world_size) for _ in steps)
        seen_total += sum(2.0 + r for r in range(world_size) for _ in steps)
        tokens_total += sum(10.0 * (r + 1) for r in range(world_size) for _ in steps)
        expected[steps[-1]] = {
            "train/loss": weighted / weight,
            "train/seen": seen_total,
            "train/worst": float(max(s * (r + 1) for r in range(world_size) for s in steps)),
            "train/tokens": tokens_total,
            "train/learning_rate": 0.1 * steps[-1],
        }
    return expected


@pytest.mark.timeout(180)
def test_two_ranks_export_exact_windows_and_close_exports_the_partial_window(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    results = run_ranks(_train_two_ranks, 2, str(path))
    assert [r["exporting"] for r in results] == [True, False]
    host_timed = {"train/tokens_per_second", "train/samples_per_second", "train/phases/share"}
    host_timed |= {"train/goodput", "train/goodput/wall_time", "train/goodput/productive_time"}
    host_timed |= {"train/step_time/histogram"}  # each rank's own steps (the exporting rank's is exported)
    same = [{k: v for k, v in r["latest"].items() if k not in host_timed} for r in results]
    assert same[0] == same[1], "every rank sees the same collected results"

    lines = _read_jsonl(path)
    expected = _expected_windows(2)
    assert [line["step"] for line in lines] == sorted(expected)
    for line in lines:
        values = line["values"]
        assert line["run_id"] == "run-a"
        for name, value in expected[line["step"]].items():
            assert values[name] == pytest.approx(value, rel=1e-12), (line["step"], name)
        assert set(values["train/step_time"]) == {"0", "1"}
        assert values["train/tokens_per_second"] > 0
        assert values["exporter/exported_reports"]["jsonl"] >= 0


def _counter_restart(rank: int, world_size: int, path: str, checkpoint: str) -> float:
    metrics = {"seen": tt.SumMetric(kind="counter")}
    first = tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=2, run_id="restart", signals=False)
    for step in range(4):
        metrics["seen"].update(1.0)
        first.step(step)
    metrics["seen"].update(5.0)  # accumulated but not yet collected: must survive the checkpoint
    state = first.state_dict()
    first.close()
    if rank == 0:
        torch.save(state, checkpoint)
    dist.barrier()

    restored = {"seen": tt.SumMetric(kind="counter")}
    second = tt.Telemetry(restored, [tt.JsonlExporter(path)], every=2, run_id="restart", signals=False)
    second.load_state_dict(torch.load(checkpoint) if rank == 0 else state)
    for step in range(4, 6):
        restored["seen"].update(1.0)
        second.step(step)
    second.close()
    return float(second.latest["seen"])


@pytest.mark.timeout(180)
def test_counters_continue_across_a_restart_from_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    totals = run_ranks(_counter_restart, 2, str(path), str(tmp_path / "ckpt.pt"))
    # 2 ranks x (4 + 2 updates of 1) + 2 ranks x 5 carried in the local state
    assert totals == [22.0, 22.0]
    exported = [line["values"]["seen"] for line in _read_jsonl(path)]
    assert exported == sorted(exported), "a counter never goes down across the restart"
    assert exported[-1] == 22.0


class _SlowCompute(tt.SumMetric):
    """A sum whose compute() is slow, so collections fall behind the loop."""

    def compute(self) -> torch.Tensor:
        time.sleep(0.2)
        return super().compute()


def test_slow_collections_apply_backpressure_and_lose_nothing(tmp_path: Path) -> None:
    metrics = {"seen": _SlowCompute(kind="counter")}
    path = tmp_path / "metrics.jsonl"
    telemetry = tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=1, max_pending=2, signals=False)
    for step in range(8):
        metrics["seen"].update(1.0)
        telemetry.step(step)
        assert telemetry._collector.pending <= 2
    telemetry.close()
    assert telemetry.backpressure_waits > 0
    lines = _read_jsonl(path)
    assert [line["step"] for line in lines] == list(range(8))
    assert [line["values"]["seen"] for line in lines] == [float(n) for n in range(1, 9)]


def test_single_process_without_distributed(tmp_path: Path) -> None:
    metrics = {"acc": tt.AccuracyMetric()}
    path = tmp_path / "m.jsonl"
    with tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=4) as telemetry:
        for step in range(6):
            metrics["acc"].update(torch.tensor([step % 2, 1]), torch.tensor([1, 1]))
            telemetry.step(step)
    lines = _read_jsonl(path)
    assert [line["step"] for line in lines] == [3, 5]
    assert lines[0]["values"]["acc"] == pytest.approx(6 / 8)
    assert lines[1]["values"]["acc"] == pytest.approx(3 / 4)
    assert telemetry.is_exporting
    with pytest.raises(RuntimeError, match="closed"):
        telemetry.step(7)
    with pytest.raises(RuntimeError, match=r"Telemetry\.log: telemetry is closed"):
        telemetry.log({"acc": 1.0}, 7)


def test_names_that_clash_with_the_built_in_signals_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"train/tokens.*defined twice|defined twice.*train/tokens"):
        tt.Telemetry({"train": {"tokens": tt.SumMetric()}}, [])


def test_illegal_metric_names_fail_at_construction() -> None:
    with pytest.raises(tt.report.InvalidMetricNameError, match="grad norm"):
        tt.Telemetry({"grad norm": tt.MaxMetric()}, [], signals=False)


NOT_MAPPINGS = {
    "a list": ([tt.SumMetric()], "the metric tree is a list"),
    "a tuple": ((tt.SumMetric(), tt.MaxMetric()), "the metric tree is a tuple"),
    "a bare Metric": (tt.SumMetric(), "the metric tree is a SumMetric"),
    "a list in a dict": ({"train": [tt.SumMetric()]}, "'train' in the metric tree is a list"),
    "a tuple deeper": (
        {"train": {"losses": (tt.SumMetric(),)}},
        "'train/losses' in the metric tree is a tuple",
    ),
}


@pytest.mark.parametrize(("metrics", "problem"), list(NOT_MAPPINGS.values()), ids=list(NOT_MAPPINGS))
def test_a_metric_tree_that_is_not_a_mapping_is_refused_naming_where(metrics: Any, problem: str) -> None:
    """Its metrics would be named by position (a list exported as `0`); the functional API keeps
    taking any PyTree, named by position as it was given."""
    with pytest.raises(TypeError, match=re.escape(problem) + r".*not a mapping of names to Metrics"):
        tt.Telemetry(metrics, [])
    assert tt.sync_and_compute(metrics) is not None
    assert tt.sync_metrics(metrics) is None


def test_above_the_rank_series_limit_step_time_becomes_min_median_max() -> None:
    telemetry = tt.Telemetry({"x": tt.SumMetric()}, [], max_rank_series=0, every=2)
    names = {d.name for d in telemetry.descriptors}
    assert {"train/step_time/min", "train/step_time/median", "train/step_time/max"} <= names
    assert "train/step_time" not in names
    for step in range(4):
        telemetry.step(step)
    telemetry.close()
    assert "train/step_time/median" in telemetry.latest
    assert "train/step_time" not in telemetry.latest


class _ElsewhereMetric(tt.Metric):
    """State on another device ("meta"), results that do not read it: only bind() can object."""

    def __init__(self) -> None:
        super().__init__()
        self.total = tt.MetricAccumulator(0.0, "sum", device="meta")

    def compute(self) -> torch.Tensor:
        return torch.tensor(0.0)


def test_a_failed_set_up_leaves_no_exporter_running() -> None:
    exporter = tt.PrometheusExporter(port=0)
    threads_before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="several devices"):
        tt.Telemetry({"a": tt.SumMetric(), "b": _ElsewhereMetric()}, [exporter], signals=False)
    assert exporter.url is None, "the scrape endpoint was closed again"
    assert {t.name for t in threading.enumerate()} <= threads_before, "no exporter thread left"


def test_a_state_without_its_window_is_refused_naming_what_it_holds() -> None:
    telemetry = tt.Telemetry({"loss": tt.WeightedMeanMetric()}, every=2)
    with pytest.raises(ValueError, match=r"no 'window' entry \(keys: \['counters', 'metrics'\]\)"):
        telemetry.load_state_dict({"metrics": {}, "counters": "{}"})
    telemetry.close()


def _saved_histogram_run(tmp_path: Path) -> dict[str, Any]:
    """A checkpoint of a run whose histogram saw 12 values in (1, 3]: 8 in a window already
    exported (its running total) and 4 in the partial window."""
    metrics = {"grad": tt.HistogramMetric([1.0, 3.0, 5.0]), "seen": tt.SumMetric(kind="counter")}
    with tt.Telemetry(metrics, [], every=2, signals=False) as telemetry:
        for step in range(3):
            metrics["grad"].update(torch.full((4,), 2.0))
            metrics["seen"].update(1.0)
            telemetry.step(step)
        path = tmp_path / "checkpoint.pt"
        torch.save(telemetry.state_dict(), path)
    return torch.load(path, weights_only=False)


def test_a_checkpoint_loads_only_into_the_configuration_it_was_saved_with(tmp_path: Path) -> None:
    state = _saved_histogram_run(tmp_path)
    same_count = {"grad": tt.HistogramMetric([10.0, 20.0, 30.0]), "seen": tt.SumMetric(kind="counter")}
    with tt.Telemetry(same_count, [], every=2, signals=False) as telemetry:
        with pytest.raises(ValueError, match=r"'grad' was saved with another configuration \(bins="):
            telemetry.load_state_dict(state)
        assert same_count["grad"].counts.local.sum().item() == 0, "nothing was loaded"
    gauge = {"grad": tt.HistogramMetric([1.0, 3.0, 5.0]), "seen": tt.SumMetric()}
    with (
        tt.Telemetry(gauge, [], every=2, signals=False) as telemetry,
        pytest.raises(ValueError, match=r"'seen'.*kind='counter' saved, kind='gauge' now"),
    ):
        telemetry.load_state_dict(state)
    same = {"grad": tt.HistogramMetric([1.0, 3.0, 5.0]), "seen": tt.SumMetric(kind="counter")}
    with tt.Telemetry(same, [], every=2, signals=False) as telemetry:
        telemetry.load_state_dict(state)
        telemetry.step(3)
    assert telemetry.latest["grad"].counts == (0.0, 12.0, 0.0, 0.0), "8 totalled, 4 in the partial window"


def test_a_metric_removed_since_the_checkpoint_is_left_out_with_a_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _saved_histogram_run(tmp_path)
    kept = {"seen": tt.SumMetric(kind="counter")}
    with tt.Telemetry(kept, [], every=2, signals=False) as telemetry, caplog.at_level(logging.WARNING):
        telemetry.load_state_dict(state)
        telemetry.step(3)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("['grad']" in message and "partial window is left out" in message for message in warnings)
    assert any("['grad']" in message and "running totals" in message for message in warnings)
    assert telemetry.latest == {"seen": 3.0}


@pytest.mark.parametrize(
    ("logged", "named"),
    [
        ({"train/acc": 777.0, "eval/acc": 0.5}, r"\['train/acc'\] are names of this run's own metrics"),
        ({"train/tokens": 5.0}, r"\['train/tokens'\] are names of this run's own"),
        ({"train/tokens_per_second": 5.0}, r"\['train/tokens_per_second'\] are names"),
        ({"exporter/errors": 1.0}, r"\['exporter/errors'\] are names"),
        ({"my loss": 1.0, "my_loss": 2.0}, r"\['my loss', 'my_loss'\] -> 'my_loss'"),
    ],
    ids=["a window's metric", "a built-in signal", "a derived signal", "exporter health", "one path"],
)
def test_logged_values_never_replace_and_are_never_replaced_by_the_run_s_own(
    tmp_path: Path, logged: dict[str, float], named: str
) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = {"train": {"acc": tt.WeightedMeanMetric()}}
    with tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=2, max_pending=2) as telemetry:
        for step in range(2):
            metrics["train"]["acc"].update(0.25)
            telemetry.step(step, tokens=10)
        # The window ending at step 1 is in flight: logged values at step 1 would ride in its report.
        with pytest.raises(tt.report.NameCollisionError, match=named) as refused:
            telemetry.log(logged, step=1)
        assert "Nothing of this call was exported" in str(refused.value)
        telemetry.log({"eval/acc": 0.5}, step=1)
    (report,) = _read_jsonl(path)
    assert report["step"] == 1
    assert report["values"]["train/acc"] == 0.25 and report["values"]["eval/acc"] == 0.5
    assert report["values"]["train/tokens"] == 20.0
    assert "my_loss" not in report["values"]
