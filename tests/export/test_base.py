"""`BaseExporter`: the lifecycle every exporter shares, and the docs' TensorBoard exporter run for real."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.export import (
    BaseExporter,
    Exporter,
    ExportFailed,
    ExportHub,
    ExportResult,
    MetricDescriptor,
    ReportValues,
    RunInfo,
)

DOCS = Path(__file__).parents[2] / "docs" / "exporters.md"
RUN = RunInfo(run_id="base-run")


class ListExporter(BaseExporter):
    """Keeps reports in a list; fails the steps in `failing`; refuses names in `refused`."""

    def __init__(self, failing: Sequence[int] = (), refused: Sequence[str] = ()) -> None:
        super().__init__("list")
        self.failing = set(failing)
        self.refused = set(refused)
        self.reports: list[tuple[int, dict[str, Any]]] = []
        self.calls: list[str] = []

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        bad = sorted(self.refused & {d.name for d in descriptors})
        if bad:
            raise ValueError(f"refused {bad}")
        self.calls.append("describe")

    def _start(self, run: RunInfo) -> None:
        self.calls.append("start")

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        if step in self.failing:
            raise ExportFailed(f"step {step} is in failing")
        self.reports.append((step, dict(values)))

    def _flush(self, timeout_s: float) -> bool:
        self.calls.append("flush")
        return True

    def _close(self, timeout_s: float) -> None:
        self.calls.append("close")


def _docs_snippet(heading: str) -> str:
    text = DOCS.read_text()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_lifecycle_is_the_base_class_s(caplog: pytest.LogCaptureFixture) -> None:
    exporter = ListExporter(failing=[2, 3])
    assert isinstance(exporter, Exporter)
    assert exporter.export(0, {"x": 1.0}, 0.0) is ExportResult.FAILURE  # before describe
    exporter.describe([MetricDescriptor("x")], RUN)
    exporter.describe([MetricDescriptor("y")], RUN)
    assert exporter.calls == ["describe", "start", "describe"]  # started once
    with caplog.at_level(logging.INFO):
        results = [exporter.export(step, {"x": float(step)}, 0.0) for step in (1, 2, 3, 4)]
    assert results == [ExportResult.SUCCESS, ExportResult.FAILURE, ExportResult.FAILURE, ExportResult.SUCCESS]
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "is in failing" in m]) == 1  # once per burst
    assert any("ListExporter 'list': recovered after 2 failures" in m for m in messages)
    assert exporter.force_flush(1)
    exporter.close()
    assert exporter.calls[-2:] == ["flush", "close"]  # close flushes first
    assert exporter.export(5, {"x": 5.0}, 0.0) is ExportResult.FAILURE
    assert not exporter.force_flush(1)
    with pytest.warns(RuntimeWarning, match="ListExporter 'list': already closed"):
        exporter.close()
    assert exporter.calls.count("close") == 1
    assert [step for step, _ in exporter.reports] == [1, 4]


def test_a_name_the_backend_refuses_raises_from_describe_and_starts_nothing() -> None:
    exporter = ListExporter(refused=["bad"])
    with pytest.raises(ValueError, match="refused"):
        exporter.describe([MetricDescriptor("bad")], RUN)
    assert exporter.calls == []
    exporter.close()
    assert exporter.calls == ["close"]  # never started: nothing to flush, still released


def test_a_hook_that_raises_anything_is_a_failure_not_an_exception(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ListExporter):
        def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
            raise KeyError(step)

        def _flush(self, timeout_s: float) -> bool:
            raise OSError("disk full")

    exporter = Broken()
    exporter.describe([], RUN)
    with caplog.at_level(logging.ERROR):
        assert exporter.export(1, {}, 0.0) is ExportResult.FAILURE
        assert not exporter.force_flush(1)
        exporter.close()
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        "Broken 'list': step 1: export failed: KeyError: 1"  # one line for the burst of three
    ]


def test_the_documented_tensorboard_exporter_runs(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    namespace: dict[str, Any] = {}
    exec(compile(_docs_snippet("## Writing an exporter"), str(DOCS), "exec"), namespace)
    code_lines = [line for line in _docs_snippet("## Writing an exporter").splitlines() if line.strip()]
    assert len(code_lines) <= 55, "the documented exporter should stay about 50 lines"

    exporter = namespace["MinimalTensorBoardExporter"](str(tmp_path))
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}, "grad_norm": tt.HistogramMetric(bins=[1.0, 2.0])}
    telemetry = tt.Telemetry(metrics, [exporter], every=2, run_id="tb-run")
    for step in range(4):
        metrics["train"]["loss"].update(torch.tensor([float(step)]))
        metrics["grad_norm"].update(torch.tensor([0.5, 1.5, 3.0]))
        telemetry.step(step)
    telemetry.close()

    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name == "tb-run"
    events = event_accumulator.EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "grad_norm/mean", "grad_norm/count", "train/step_time/0"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (3, 2.5)]
    assert [e.value for e in events.Scalars("grad_norm/count")] == [6.0, 12.0]  # running totals
    health = telemetry.hub.health()[exporter.name]
    assert (health.exported_reports, health.errors) == (2, 0)


def test_the_hub_drives_a_base_exporter_like_any_other() -> None:
    exporter = ListExporter(failing=[2])
    hub = ExportHub([exporter], run=RUN)
    hub.describe([MetricDescriptor("x")])
    for step in (1, 2, 3):
        hub.submit(step, {"x": float(step)})
    hub.close(30)
    assert [step for step, _ in exporter.reports] == [1, 3]
    health = hub.health()["list"]
    assert (health.exported_reports, health.errors) == (2, 1)
    assert exporter.calls[-2:] == ["flush", "close"]


def test_one_failure_through_the_hub_logs_one_line_and_counts_once(caplog: pytest.LogCaptureFixture) -> None:
    exporter = ListExporter(failing=[2])
    hub = ExportHub([exporter], run=RUN)
    hub.describe([MetricDescriptor("x")])
    with caplog.at_level(logging.WARNING, logger="torchtelemetry"):
        for step in (1, 2, 3):
            hub.submit(step, {"x": float(step)})
        hub.close(30)
    failures = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert failures == [
        "ListExporter 'list': step 2: step 2 is in failing; "
        "further failures are counted, not logged, until one succeeds"
    ]
    health = hub.health()["list"]
    assert (health.exported_reports, health.errors, health.dropped_reports) == (2, 1, 0)
