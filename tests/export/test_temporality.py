"""Temporality: each exporter gets the temporality it declared, from the running totals kept in one place."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.export import (
    BaseExporter,
    ExportHub,
    HistogramValue,
    MetricDescriptor,
    ReportValues,
    RunInfo,
    Temporality,
)
from torchtelemetry.metric import MetricKind

RUN = RunInfo(run_id="temporality")
TOKENS = MetricDescriptor("train/tokens", MetricKind.COUNTER)
GRAD = MetricDescriptor("grad_norm", MetricKind.HISTOGRAM)


class DeltaRecorder(BaseExporter):
    """Wants counters and histograms as deltas; fails the steps in `failing`; can hold an export."""

    preferred_temporality: ClassVar = {
        MetricKind.COUNTER: Temporality.DELTA,
        MetricKind.HISTOGRAM: Temporality.DELTA,
    }

    def __init__(self, name: str = "delta", failing: Sequence[int] = ()) -> None:
        super().__init__(name)
        self.failing = set(failing)
        self.reports: dict[int, dict[str, Any]] = {}
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        self.entered.set()
        self.hold.wait(30)
        if step in self.failing:
            raise RuntimeError(f"step {step} fails")
        self.reports[step] = dict(values)


class TotalRecorder(DeltaRecorder):
    preferred_temporality: ClassVar = {}


def _histogram(counts: tuple[float, ...]) -> HistogramValue:
    return HistogramValue(bounds=(1.0,), counts=counts, sum=sum(counts), count=sum(counts))


def test_each_exporter_gets_the_temporality_it_declared_and_nothing_is_lost_to_drops_or_failures() -> None:
    delta, total = DeltaRecorder(failing=[3]), TotalRecorder("total")
    hub = ExportHub([delta, total], run=RUN, queue_size=1)
    hub.describe([TOKENS, GRAD])
    delta.hold.clear()
    for step in range(1, 7):  # every window adds 10 tokens and one value per bucket
        report = {"train/tokens": 10.0 * step, "grad_norm": _histogram((step, step))}
        window = {"train/tokens": 10.0, "grad_norm": _histogram((1.0, 1.0))}
        hub.submit(step, report, window=window)
        if step == 1:
            assert delta.entered.wait(30)  # step 1 is held inside export: 2, 3 and 4 queue behind it
    delta.hold.set()
    hub.close(30)
    # The held exporter got step 1, then the queue's survivors; dropped (2..4) and failed reports
    # are folded into the next delta, so the deltas it accepted add up to the totals.
    accepted = sorted(delta.reports)
    assert accepted[0] == 1 and accepted[-1] == 6
    tokens = [delta.reports[step]["train/tokens"] for step in accepted]
    assert tokens[0] == 10.0 and sum(tokens) == 60.0
    assert sum(delta.reports[step]["grad_norm"].counts[0] for step in accepted) == 6.0
    assert hub.health()["delta"].dropped_reports >= 1
    # The cumulative exporter got running totals, as given.
    assert total.reports[6]["train/tokens"] == 60.0
    assert total.reports[6]["grad_norm"].counts == (6.0, 6.0)
    # The hub's own counters are counters too: a delta exporter sees them per report, each report
    # it accepted counting itself once (a failed one counts nothing).
    health = [delta.reports[step]["exporter/exported_reports"]["delta"] for step in accepted]
    assert health == [1.0] * len(accepted)


def test_a_failed_report_is_folded_into_the_next_delta() -> None:
    delta = DeltaRecorder(failing=[2])
    hub = ExportHub([delta], run=RUN)
    hub.describe([TOKENS])
    for step in (1, 2, 3):
        hub.submit(step, {"train/tokens": 10.0 * step}, window={"train/tokens": 10.0})
    hub.close(30)
    assert {step: r["train/tokens"] for step, r in delta.reports.items()} == {1: 10.0, 3: 20.0}


def test_after_a_restart_the_first_delta_is_the_window_and_totals_continue(tmp_path: Path) -> None:
    def run(steps: range, state: dict[str, Any] | None, path: Path) -> tuple[DeltaRecorder, Any]:
        metrics = {"train": {"seen": tt.SumMetric(kind="counter")}}
        delta = DeltaRecorder()
        telemetry = tt.Telemetry(metrics, [delta, tt.JsonlExporter(path)], every=2, signals=False)
        if state is not None:
            telemetry.load_state_dict(state)
        for step in steps:
            metrics["train"]["seen"].update(torch.tensor(1.0))
            telemetry.step(step)
        saved = telemetry.state_dict()
        telemetry.close()
        return delta, saved

    first, state = run(range(4), None, tmp_path / "a.jsonl")
    second, _ = run(range(4, 8), state, tmp_path / "b.jsonl")
    assert {step: r["train/seen"] for step, r in first.reports.items()} == {1: 2.0, 3: 2.0}
    assert {step: r["train/seen"] for step, r in second.reports.items()} == {5: 2.0, 7: 2.0}
    totals = [json.loads(line)["values"]["train/seen"] for line in (tmp_path / "b.jsonl").open()]
    assert totals == [6.0, 8.0]  # the cumulative exporter continues from the checkpointed totals


def test_a_bad_declaration_is_an_error_naming_the_exporter() -> None:
    class Confused(TotalRecorder):
        preferred_temporality: ClassVar = {MetricKind.GAUGE: Temporality.DELTA}

    with pytest.raises(ValueError, match=r"exporter 'confused': preferred_temporality maps"):
        ExportHub([Confused("confused")], run=RUN)
