"""Metric path rules (report/_naming.py) and flattening of results (report/_flatten.py)."""

from __future__ import annotations

import pytest
import torch

from torchtelemetry import (
    AccuracyMetric,
    HistogramMetric,
    PerRankMetric,
    SumMetric,
    WeightedMeanMetric,
    sync_metrics,
)
from torchtelemetry.export import HistogramValue, MetricDescriptor
from torchtelemetry.metric import MetricKind, metric_leaves
from torchtelemetry.report import (
    InvalidMetricNameError,
    describe_metrics,
    flatten_results,
    path_segment,
    sanitize_path,
    to_python,
    validate_path,
)

COUNTER, HISTOGRAM = MetricKind.COUNTER, MetricKind.HISTOGRAM


@pytest.mark.parametrize("path", ["", "a//b", "/a", "a/", "bad name", "a/b$c", "x" * 201, "-lead"])
def test_illegal_paths_are_rejected_with_the_name(path: str) -> None:
    with pytest.raises(InvalidMetricNameError, match="metric name"):
        validate_path(path)


def build_metrics() -> dict:
    return {
        "train": {
            "loss": WeightedMeanMetric(description="loss"),
            "tokens": SumMetric(kind="counter", unit="tokens"),
        },
        "accuracy": AccuracyMetric(),
        "grad_norm": HistogramMetric(bins=[1.0, 2.0]),
        "step_time": PerRankMetric(2, 1, unit="seconds"),
    }


def test_describe_and_flatten_a_metric_tree() -> None:
    metrics = build_metrics()
    metrics["train"]["loss"].update(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]))
    metrics["train"]["tokens"].update(torch.tensor(12.0))
    metrics["grad_norm"].update(torch.tensor([0.5, 1.5, 2.0, 9.0]))
    metrics["step_time"].update(torch.tensor(0.25))
    sync_metrics(metrics)  # no process group: the local state becomes the synchronized one
    descriptors = {d.name: d for d in describe_metrics(metrics)}
    leaves = metric_leaves(metrics)
    flat = flatten_results(leaves, [to_python(metric.compute()) for _, metric in leaves])
    assert set(flat) == set(descriptors)
    assert descriptors["train/tokens"] == MetricDescriptor("train/tokens", COUNTER, "tokens", "", None)
    assert descriptors["step_time"].label_name == "rank" and descriptors["step_time"].unit == "seconds"
    assert descriptors["grad_norm"].kind is HISTOGRAM
    assert flat["train/loss"] == 2.0 and flat["train/tokens"] == 12.0
    assert flat["grad_norm"] == HistogramValue(bounds=(1.0, 2.0), counts=(1.0, 2.0, 1.0), sum=13.0, count=4.0)
    assert flat["grad_norm"].cumulative_counts() == [1.0, 3.0, 4.0]
    assert flat["step_time"]["1"] == 0.25 and set(flat["step_time"]) == {"0", "1"}


def test_illegal_metric_tree_names_fail_when_described() -> None:
    with pytest.raises(InvalidMetricNameError, match="bad key"):
        describe_metrics({"bad key": SumMetric()})


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ("mfu(%)", "mfu_pct"),
        ("memory/max_active(GiB)", "memory/max_active_GiB"),
        ("throughput(tps)", "throughput_tps"),
        ("loss_metrics//global avg loss", "loss_metrics/global_avg_loss"),
    ],
)
def test_sanitize_path_makes_framework_keys_legal(raw: str, path: str) -> None:
    assert sanitize_path(raw) == path


def test_sanitize_path_rejects_what_cannot_be_made_legal() -> None:
    with pytest.raises(InvalidMetricNameError):
        sanitize_path("()/(!)")


def test_path_segment_replaces_each_run_of_illegal_characters_once() -> None:
    assert path_segment("a/b c") == "a_b_c"
    assert path_segment("d  e%/") == "d_e_"
    assert validate_path(path_segment("any thing: at all")) == "any_thing_at_all"
