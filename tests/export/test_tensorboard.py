"""TensorBoardExporter: event files written by a real run, read back with TensorBoard's own reader."""

from __future__ import annotations

import itertools
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.export.trackers import CONFIG, NO_HISTOGRAM, TIMESTAMPS, export_label_clashes, tracker_rank
from tests.export.workload import BINS, STEPS, expected_values
from torchtelemetry.export import (
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    RunInfo,
    TensorBoardExporter,
)
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import NameCollisionError

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def read_events(log_dir: Path):
    """Every event in `log_dir`, through TensorBoard's `EventAccumulator` (nothing sampled away)."""
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def test_two_ranks_event_files_hold_exact_values_buckets_and_config(tmp_path: Path) -> None:
    options = {"log_dir": str(tmp_path / "tb")}
    results = run_ranks(tracker_rank, 2, "TensorBoardExporter", options, "tb-two-ranks", timeout_s=180)
    assert results == [{"reports": len(STEPS), "errors": 0}, {}]

    events = read_events(tmp_path / "tb")
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # rank 1 wrote nothing
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    assert [(e.step, e.wall_time) for e in scalars["train/loss"]] == list(zip(STEPS, TIMESTAMPS, strict=True))
    expected = [expected_values(2, window + 1) for window in range(len(STEPS))]
    # TensorBoard keeps scalars as float32
    assert [e.value for e in scalars["train/loss"]] == pytest.approx(
        [values["train/loss"] for values in expected], rel=1e-6
    )
    assert [e.value for e in scalars["tokens"]] == [values["tokens"] for values in expected]  # running totals
    for rank in ("0", "1"):
        assert [e.value for e in scalars[f"step_time/rank_{rank}"]] == [0.25 * (int(rank) + 1)] * 3
    assert [e.value for e in scalars["exporter/exported_reports/exporter_tensorboard"]] == [1.0, 2.0, 3.0]

    histograms = events.Histograms("grad_norm")
    assert [(h.step, h.wall_time) for h in histograms] == list(zip(STEPS, TIMESTAMPS, strict=True))
    totals = [NO_HISTOGRAM] + [values["grad_norm"] for values in expected]
    for index, ((before, now), event) in enumerate(zip(itertools.pairwise(totals), histograms, strict=True)):
        histogram = event.histogram_value
        window = [a - b for a, b in zip(now["counts"], before["counts"], strict=True)]
        # the interval's exact buckets between the bounds, and nothing drawn where no edge is known:
        # the open outer buckets are scalars of their own
        assert (histogram.min, list(histogram.bucket_limit)) == (BINS[0], BINS[1:])
        assert list(histogram.bucket) == window[1:-1]
        assert histogram.num == sum(window[1:-1])
        assert math.isnan(histogram.sum) and math.isnan(histogram.sum_squares)  # not tracked: not invented
        assert scalars["grad_norm/underflow"][index].value == window[0]
        assert scalars["grad_norm/overflow"][index].value == window[-1]
    assert sum(window[0] + window[-1] for window in _windows(totals)) > 0, "the outer buckets are used"

    (text,) = events.Tensors("run/config/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert "run id: `tb-two-ranks`, world size: 2" in markdown
    assert json.loads(markdown.split("```json\n")[1].split("\n```")[0]) == CONFIG


def test_a_telemetry_run_writes_to_runs_run_id_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    exporter = tt.TensorBoardExporter()
    telemetry = tt.Telemetry(metrics, [exporter], every=2, run_id="tb-default")
    for step in range(4):
        metrics["train"]["loss"].update(torch.tensor([float(step)]))
        telemetry.step(step)
    telemetry.close()
    assert exporter.log_dir == Path("runs") / "tb-default"
    events = read_events(tmp_path / "runs" / "tb-default")
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (3, 2.5)]
    health = telemetry.hub.health()["tensorboard"]
    assert (health.exported_reports, health.errors) == (2, 0)


def test_values_per_label_and_histograms_written_directly(tmp_path: Path) -> None:
    exporter = TensorBoardExporter(tmp_path)
    descriptors = [
        MetricDescriptor("grad", MetricKind.HISTOGRAM),
        MetricDescriptor("perf/step_time", unit="seconds", label_name="rank"),
        MetricDescriptor("queue", label_name="host"),
    ]
    exporter.describe(descriptors, RunInfo(run_id="kinds"))
    value = HistogramValue(bounds=(-1.0, 0.0, 4.0), counts=(2.0, 0.0, 5.0, 1.0), sum=9.5, count=8.0)
    scalars = {"grad": value, "perf/step_time": {"0": 0.5, "1": 0.75}, "queue": {"node-1:8080": 3.0}}
    assert exporter.export(7, scalars, 1234.5) is ExportResult.SUCCESS
    assert exporter.force_flush()  # on disk before close
    events = read_events(tmp_path)
    (histogram,) = events.Histograms("grad")
    assert list(histogram.histogram_value.bucket) == [0.0, 5.0]  # (-1, 0] and (0, 4]
    assert list(histogram.histogram_value.bucket_limit) == [0.0, 4.0]
    assert (histogram.histogram_value.min, histogram.histogram_value.max) == (-1.0, 4.0)
    assert histogram.histogram_value.num == 5.0
    assert {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]} == {
        "perf/step_time/rank_0": 0.5,
        "perf/step_time/rank_1": 0.75,
        "queue/host_node-1_8080": 3.0,  # a label value cannot add path segments or odd characters
        "grad/underflow": 2.0,  # at or below -1: no edge is known for them, so they are counted apart
        "grad/overflow": 1.0,  # above 4
    }
    exporter.close()


def test_label_values_sanitized_into_one_tag_are_left_out_counted_and_logged(tmp_path: Path, caplog) -> None:
    export_label_clashes(TensorBoardExporter(tmp_path), caplog)
    events = read_events(tmp_path)

    def written(tag: str) -> list[tuple[int, float]]:
        return [(event.step, event.value) for event in events.Scalars(tag)]

    assert written("queue/host_a_b") == [(1, 1.0), (3, 3.0)]  # only 'a/b'
    assert written("step_time/rank_0") == [(1, 0.75)]  # only the metric
    assert written("step_time/rank_1") == [(1, 0.25)]
    assert written("train/loss") == [(1, 0.5), (2, 0.25)]  # the rest is written


def test_an_unwritable_log_dir_counts_failures_and_training_goes_on(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    exporter = tt.TensorBoardExporter(blocker / "tb")
    with caplog.at_level(logging.ERROR):
        telemetry = tt.Telemetry(metrics, [exporter], every=1, run_id="tb-dead")
        for step in range(5):
            metrics["train"]["loss"].update(torch.tensor([1.0]))
            telemetry.step(step)
        telemetry.close()
    assert "cannot write event files" in caplog.text
    health = telemetry.hub.health()["tensorboard"]
    assert health.exported_reports == 0
    assert health.errors + health.dropped_reports == 5  # every report accounted for


def test_bad_arguments_and_missing_package(monkeypatch) -> None:
    with pytest.raises(ValueError, match="flush_secs must be positive"):
        TensorBoardExporter(flush_secs=0)
    with pytest.raises(ValueError, match="max_queue must be at least 1"):
        TensorBoardExporter(max_queue=0)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"torchtelemetry\[tensorboard\]"):
        TensorBoardExporter()


def test_constructor_writes_nothing(tmp_path: Path) -> None:
    exporter = TensorBoardExporter(tmp_path / "tb")
    assert exporter.export(1, {"x": 1.0}, 0.0) is ExportResult.FAILURE
    exporter.close()
    assert not (tmp_path / "tb").exists()


def _windows(totals: list[dict]) -> list[list[float]]:
    return [
        [a - b for a, b in zip(now["counts"], before["counts"], strict=True)]
        for before, now in itertools.pairwise(totals)
    ]


def test_a_metric_named_like_a_histograms_outer_bucket_is_a_collision(tmp_path: Path) -> None:
    descriptors = [MetricDescriptor("grad", MetricKind.HISTOGRAM), MetricDescriptor("grad/overflow")]
    with pytest.raises(NameCollisionError, match="grad/overflow"):
        TensorBoardExporter(tmp_path).describe(descriptors, RunInfo(run_id="clash"))
