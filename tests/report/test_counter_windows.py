"""The counter contract, held for every built-in counter signal: a counter's window value is what the
window added (its increment). The publisher adds window values up into the running total it exports
(`RunningTotals`), so a signal that gave its own running total would be counted again every window:
its total would grow with the number of windows, not with what happened.

Without a list of counters: the same steps, collected in windows of 1, 2 and 3 steps, must end at the
same totals (an increment's sum does not depend on the windows; a running total's does). The spike
count counts windows, so it is held instead to the windows whose score passed `spike_sigma`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

import torchtelemetry as tt
from tests.report.windows import context
from tests.step_inputs import step_inputs
from torchtelemetry.metric import MetricKind
from torchtelemetry.report.signals import builtin_signals, cuda_only_descriptors

STEPS = range(10, 16)
SAVED_AT, REACHED = 9, 13
"""The checkpoint resumed from, and the step the attempt before reached (the progress file's)."""
SPIKE = "train/spike/count"


def _metrics() -> dict[str, Any]:
    """Two watched metrics (names ending in `loss`): one fed NaN (non-finite counts), one rising
    tenfold a step (spike scores)."""
    return {"train": {"loss": tt.WeightedMeanMetric(), "nan_loss": tt.WeightedMeanMetric()}}


def _checkpoint() -> dict[str, Any]:
    with tt.Telemetry(_metrics(), run_id="counters", every=1, hang_after_s=None, capture_on=()) as telemetry:
        for step in range(SAVED_AT + 1):
            telemetry.step(step)
        state = telemetry.state_dict()
        telemetry.checkpoint_saved(SAVED_AT)
    return state


def _resumed_run(tmp_path: Path, every: int, state: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """`STEPS`, resumed from `state` (one restart, `REACHED - SAVED_AT` steps trained again), in
    windows of `every` steps: the totals at the end and the run's counter names."""
    progress = tmp_path / f"progress-{every}.json"
    progress.write_text(json.dumps({"run_id": "counters", "step": REACHED}))
    metrics = _metrics()
    fields = {"progress_file": progress, "dump_dir": tmp_path, "hang_after_s": None}
    with tt.Telemetry(metrics, every=every, **fields) as telemetry:
        telemetry.load_state_dict(state)
        for step in STEPS:
            with telemetry.phase("forward"):
                metrics["train"]["loss"].update(torch.tensor(10.0**step), 1)
                metrics["train"]["nan_loss"].update(torch.tensor([1.0, math.nan]), torch.ones(2))
            telemetry.step(step, **step_inputs())
    counters = {d.name for d in telemetry.descriptors if d.kind is MetricKind.COUNTER}
    return telemetry.latest, counters


def _keyword_counters() -> set[str]:
    """The counters of the signals fed by a `step()` keyword: every step gives them one."""
    signals = builtin_signals(context())
    try:
        return {
            d.name for s in signals if s.keywords for d in s.descriptors() if d.kind is MetricKind.COUNTER
        }
    finally:
        for signal in signals:
            signal.close()


def test_every_counter_exports_the_same_total_however_the_steps_are_windowed(tmp_path: Path) -> None:
    state = _checkpoint()
    runs = {every: _resumed_run(tmp_path, every, state) for every in (1, 2, 3)}
    counters = runs[1][1] - {SPIKE}
    totals = {every: {name: latest.get(name) for name in counters} for every, (latest, _) in runs.items()}
    assert totals[1] == totals[2] == totals[3]
    fed = {name for name, total in totals[1].items() if total}
    cuda_only = {d.name for d in cuda_only_descriptors()}
    # the check looked at something: each counter a CPU run can feed, fed here
    assert _keyword_counters() | {"train/nonfinite/count", "train/goodput/restarts"} <= fed
    assert totals[1]["train/goodput/recomputed_steps"] == REACHED - SAVED_AT
    assert counters - fed <= cuda_only, sorted(counters - fed - cuda_only)


def test_the_spike_count_adds_one_per_window_that_spiked(tmp_path: Path) -> None:
    path = tmp_path / "spikes.jsonl"
    metrics = _metrics()
    exporters = [tt.JsonlExporter(path)]
    with tt.Telemetry(metrics, exporters, every=1, hang_after_s=None, dump_dir=tmp_path) as telemetry:
        for step in range(14):
            metrics["train"]["loss"].update(torch.tensor(10.0**step), 1)
            telemetry.step(step)
    spiked = 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        score = line["values"].get("train/spike/score", {}).get("train/loss", 0.0)
        spiked += score > telemetry.config.spike_sigma
        assert line["values"][SPIKE]["train/loss"] == spiked, line["step"]
    assert spiked >= 4
