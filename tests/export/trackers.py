"""The experiment trackers' shared workloads: test_otel's 2 ranks through an `ExportHub` on rank 0,
and reports whose label values a tracker would write under one key."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest

import torchtelemetry.export
from tests.export.workload import BINS, STEPS, global_report, make_metrics, update_window
from torchtelemetry.export import BaseExporter, ExportHub, ExportResult, MetricDescriptor, NullHub, RunInfo
from torchtelemetry.report import describe_metrics

TIMESTAMPS = [1_700_000_000.25 + 60 * window for window in range(len(STEPS))]
"""Collection time of each report (Unix seconds)."""
NO_HISTOGRAM = {"counts": [0] * (len(BINS) + 1), "sum": 0.0, "count": 0}
"""The grad_norm histogram before the first window."""
CONFIG = {"batch_size": 8, "optimizer": {"name": "adamw", "betas": [0.9, 0.95]}}
"""The run config every rank passes."""


def tracker_rank(
    rank: int, world_size: int, exporter: str, options: Mapping[str, Any], run_id: str
) -> dict[str, int]:
    """Build `torchtelemetry.export.<exporter>(**options)` on every rank; rank 0's hub exports STEPS."""
    metrics = make_metrics(rank, world_size)
    built = getattr(torchtelemetry.export, exporter)(**options)  # the same call on every rank
    run = RunInfo(run_id=run_id, world_size=world_size, config=CONFIG)
    hub = ExportHub([built], run=run) if rank == 0 else NullHub()
    hub.describe(describe_metrics(metrics))
    for window, (step, timestamp) in enumerate(zip(STEPS, TIMESTAMPS, strict=True)):
        update_window(metrics, rank, window)
        hub.submit(step, global_report(metrics), timestamp)
    hub.close(60)
    health = hub.health().get(built.name)
    return {"reports": health.exported_reports, "errors": health.errors} if health else {}


def export_label_clashes(exporter: BaseExporter, caplog: pytest.LogCaptureFixture) -> None:
    """Three reports at steps 1-3 (timestamps 1-3 s) in which label values take keys of others, then close.

    `queue` label values `a/b` and `a_b` both map to `queue/host_a_b` (`a/b` comes first, in report 1;
    report 2 has only `a_b`); rank "0" of `step_time` maps to the metric `step_time/rank_0`. Asserts
    that the reports with a clash fail, that the third succeeds and that both clashes are logged.
    """
    descriptors = [
        MetricDescriptor("train/loss"),
        MetricDescriptor("queue", label_name="host"),
        MetricDescriptor("step_time", label_name="rank"),
        MetricDescriptor("step_time/rank_0"),
    ]
    exporter.describe(descriptors, RunInfo(run_id="label-clash"))
    first = {
        "train/loss": 0.5,
        "queue": {"a/b": 1.0, "a_b": 2.0},
        "step_time": {"0": 9.0, "1": 0.25},
        "step_time/rank_0": 0.75,
    }
    with caplog.at_level(logging.ERROR):
        results = [
            exporter.export(1, first, 1.0),
            exporter.export(2, {"train/loss": 0.25, "queue": {"a_b": 5.0}}, 2.0),
            exporter.export(3, {"queue": {"a/b": 3.0}}, 3.0),
        ]
    exporter.close()
    assert results == [ExportResult.FAILURE, ExportResult.FAILURE, ExportResult.SUCCESS]
    assert "queue host='a_b' takes the key 'queue/host_a_b' of queue host='a/b'" in caplog.text
    assert "step_time rank='0' takes the key 'step_time/rank_0' of step_time/rank_0" in caplog.text
