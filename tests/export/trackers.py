"""The 2-rank workload of test_otel through an `ExportHub` on rank 0, for the experiment trackers' tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torchtelemetry.export
from tests.export.test_otel import BINS, STEPS, global_report, make_metrics, update_window
from torchtelemetry.export import ExportHub, NullHub, RunInfo
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
