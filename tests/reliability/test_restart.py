"""Checkpoint and restart: a 2-rank run killed after a torch.distributed.checkpoint save and
restarted from it exports exactly what an uninterrupted run exports (counters keep counting,
every window after the checkpoint holds the same values), as an attempt of the same run: without
`run_id=` the restarted launch finds the killed one's id, and its Pushgateway group replaces the
killed attempt's, so no alert is left firing for it.

The ranks are plain subprocesses running tests/reliability/restart_train.py, so the test can
SIGKILL all of them the way a preemption or a crashed node does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import PrometheusServer, PushgatewayServer, binary
from tests.stack._stack import alert_rules

WORLD_SIZE = 2
STEPS = 17
EVERY = 3  # windows end at steps 2, 5, 8, 11, 14; close() exports the partial window ending at 16
SAVE_EVERY = 4  # checkpoints after steps 3, 7, 11, 15: in the middle of a window
STALL_AFTER = 9  # the killed run got past the checkpoint at step 7 and scheduled the window ending at 8
CHECKPOINT_STEP = 7
# Measured on the host, so they differ between any two runs; everything else must be identical.
HOST_TIMED = {
    "train/step_time",
    "train/step_time/min_rank",
    "train/step_time/max_rank",
    "train/step_time/histogram",
    "train/tokens_per_second",
    "train/samples_per_second",
    "train/data_wait_share",  # the data wait (the same in both) over the host's step time
    "train/phases/share",
    "train/peak_memory",
    "train/memory/rss/max",
    "train/memory/rss/max_rank",
    "train/goodput",
    "train/goodput/productive_time",
    "train/goodput/wall_time",
}
RESTART_COUNTED = {"train/goodput/restarts", "train/goodput/recomputed_steps", "train/straggler/threshold"}
"""The same in both runs but for the restart itself (a restarted run learns the straggler threshold's
noise again: docs/signals.md)."""
REPO = Path(__file__).resolve().parents[2]


def _run_ids(path: Path) -> set[str]:
    return {json.loads(line)["run_id"] for line in path.read_text().splitlines()}


def _launch(tmp_path: Path, name: str, out: Path, extra: list[str]) -> list[subprocess.Popen]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    rendezvous = tmp_path / f"rendezvous-{name}"
    command = [
        sys.executable,
        "-m",
        "tests.reliability.restart_train",
        "--rendezvous",
        str(rendezvous),
        "--out",
        str(out),
        "--checkpoints",
        str(tmp_path / "checkpoints"),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--save-every",
        str(SAVE_EVERY),
        *extra,
    ]
    return [
        subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]


def _finish(procs: list[subprocess.Popen], timeout_s: float = 120) -> None:
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output}"


def _kill_when_stalled(procs: list[subprocess.Popen], out: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        markers = [Path(f"{out}.stalled.{rank}") for rank in range(WORLD_SIZE)]
        while not all(marker.exists() for marker in markers):
            failed = [proc for proc in procs if proc.poll() is not None]
            assert not failed, f"a rank exited before the stall: {failed[0].communicate()[0]}"
            assert time.monotonic() < deadline, "the ranks never reached the stall point"
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        for proc in procs:
            proc.communicate()
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * WORLD_SIZE


def _values(path: Path) -> dict[int, dict[str, Any]]:
    """Every exported value by step."""
    return {record["step"]: record["values"] for record in map(json.loads, path.read_text().splitlines())}


def _reports(path: Path) -> dict[int, dict[str, Any]]:
    """Exported values by step, without the host-timed signals and the exporter health metrics."""
    reports = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        reports[record["step"]] = {
            name: value
            for name, value in record["values"].items()
            if name not in HOST_TIMED | RESTART_COUNTED and not name.startswith("exporter/")
        }
    return reports


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[PushgatewayServer | None]:
    """A running Pushgateway where one is installed (the run is checked without it elsewhere)."""
    if binary("prometheus-pushgateway") is None and binary("pushgateway") is None:
        yield None
        return
    with PushgatewayServer(tmp_path / "pushgateway") as server:
        yield server


@pytest.mark.timeout(300)
def test_a_run_killed_after_a_checkpoint_continues_exactly_where_it_left_off(
    tmp_path: Path, gateway: PushgatewayServer | None
) -> None:
    reference_out = tmp_path / "reference.jsonl"
    killed_out, resumed_out = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"
    # The uninterrupted reference (own directory) runs alongside the run that gets killed.
    reference_run = _launch(tmp_path / "reference", "reference", reference_out, [])
    try:
        # No run_id=: the resumed launch finds the killed one's (progress file, checkpoint).
        progress = ["--progress-file", str(tmp_path / "progress.json")]
        progress += ["--pushgateway", gateway.url] if gateway is not None else []
        _kill_when_stalled(
            _launch(tmp_path, "killed", killed_out, ["--stall-after", str(STALL_AFTER), *progress]),
            killed_out,
        )
    finally:
        _finish(reference_run)
    checkpoints = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_3", f"step_{CHECKPOINT_STEP}"]
    _finish(_launch(tmp_path, "resumed", resumed_out, ["--resume", *progress]))

    # One run, two attempts: every report of both carries the killed attempt's run id.
    (run_id,) = _run_ids(killed_out)
    assert _run_ids(resumed_out) == {run_id} and _run_ids(reference_out) != {run_id}
    reference, killed, resumed = _reports(reference_out), _reports(killed_out), _reports(resumed_out)
    assert sorted(reference) == [2, 5, 8, 11, 14, 16]
    # Saving the checkpoint at step 7 exported every window collected by then; the window ending
    # at 8 was exported too before the kill. The restart redoes it.
    assert sorted(killed) == [2, 5, 8]  # the killed run waited for its window in flight
    assert sorted(resumed) == [8, 11, 14, 16]
    for step in killed:
        assert killed[step] == reference[step], f"before the kill, step {step}"
    for step in resumed:
        assert resumed[step] == reference[step], f"after the restart, step {step}"
    # Counters kept counting from the checkpointed totals rather than starting again from zero.
    assert resumed[8]["train/seen"] > killed[5]["train/seen"] > 0
    assert resumed[16]["train/grad_norm"]["count"] == 4 * WORLD_SIZE * STEPS

    # Goodput: one restart, the steps 8 of the killed run past its checkpoint at step 7 redone,
    # and the time after that checkpoint's state was taken (the work redone, the restart) lost.
    before, after = _values(killed_out), _values(resumed_out)
    assert before[8]["train/goodput/restarts"] == 0 and before[8]["train/goodput/recomputed_steps"] == 0
    assert after[8]["train/goodput/restarts"] == after[16]["train/goodput/restarts"] == 1
    assert after[8]["train/goodput/recomputed_steps"] == after[16]["train/goodput/recomputed_steps"] == 1
    # Before its first checkpoint (step 3) was marked durable, the killed run's goodput was unknown.
    assert "train/goodput" not in before[2] and "train/goodput/wall_time" not in before[2]
    for values in (before[5], before[8], *after.values()):
        assert 0 < values["train/goodput/productive_time"] < values["train/goodput/wall_time"]
        assert values["train/goodput"] == pytest.approx(
            values["train/goodput/productive_time"] / values["train/goodput/wall_time"]
        )
    # The run's first start is the killed run's: each report's wall time runs from it, so both
    # attempts' reports put it at the same moment (each timestamp is taken right after the wall time).
    first_starts = [
        record["timestamp"] - record["values"]["train/goodput/wall_time"]
        for path in (killed_out, resumed_out)
        for record in map(json.loads, path.read_text().splitlines())
        if "train/goodput/wall_time" in record["values"]
    ]
    assert max(first_starts) - min(first_starts) == pytest.approx(0, abs=1.0)
    assert after[8]["train/goodput/wall_time"] - after[8]["train/goodput/productive_time"] > (
        before[8]["train/goodput/wall_time"] - before[8]["train/goodput/productive_time"]
    )
    if gateway is not None:
        _check_gateway(gateway, run_id, tmp_path)


def _check_gateway(gateway: PushgatewayServer, run_id: str, tmp_path: Path) -> None:
    """The resumed attempt's group replaced the killed one's: one group for the run, marked finished,
    holding the resumed attempt's last report; Prometheus scraping it finds no alert to fire."""
    groups = [group for group in gateway.groups() if group.get("job") == "torchtelemetry"]
    assert [group["run"] for group in groups] == [run_id]
    if binary("prometheus") is None:
        return
    prometheus = PrometheusServer(tmp_path / "prometheus")
    prometheus.scrape("torchtelemetry-pushgateway", [gateway.address], honor_labels=True)
    with prometheus:
        selector = f'{{job="torchtelemetry", run="{run_id}"}}'
        (step,) = prometheus.wait_for(f"torchtelemetry_train_step{selector}")
        assert step.value == STEPS - 1
        (restarts,) = prometheus.query(f"torchtelemetry_train_goodput_restarts_total{selector}")
        assert restarts.value == 1
        # Nothing of the run could ever page for staleness: every group it left is marked finished.
        assert (
            prometheus.query(
                f"torchtelemetry_last_update_timestamp_seconds{selector}"
                " unless on (job, run) torchtelemetry_run_finished_timestamp_seconds"
            )
            == []
        )
        for rule in alert_rules():
            assert prometheus.query(rule["expr"]) == [], rule["alert"]
