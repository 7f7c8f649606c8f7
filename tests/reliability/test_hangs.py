"""A hang is named while it happens: three gloo ranks under DDP, one of them stops.

Every rank but one waits in a collective (DDP's all-reduce in backward) for a rank that never comes;
the exporting rank's monitor thread still exports, through JSONL and /metrics, which rank stopped,
at which step, in which phase, and the stopped rank's stack file shows where. Each test waits on the
values the run reported (bounded), never on the clock, and kills every process it started.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import free_port, run_ranks, started_ranks

WORLD = 3
STOP_STEP = 3
HANG_AFTER_S = 2.0
INTERVAL_S = 0.2
DEADLINE_S = 120.0


def _block_in_forward() -> None:
    threading.Event().wait()  # a deadlock in the data path, a stuck kernel: never returns


def _block_in_side_collective(group: dist.ProcessGroup) -> None:
    dist.barrier(group=group)  # a collective the other ranks never enter


def _die_once_published(telemetry: tt.Telemetry) -> None:
    watch = telemetry._hang_watch
    while watch.publisher.published != watch.beat.where():  # the monitor knows where it died
        time.sleep(INTERVAL_S / 4)
    os.kill(os.getpid(), signal.SIGKILL)


def _train(rank: int, world_size: int, directory: str, port: int, scenario: str) -> None:
    torch.manual_seed(0)
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.JsonlExporter(Path(directory) / "metrics.jsonl"), tt.PrometheusExporter(port=port)],
        every=2,
        run_id="hang",
        phases=("forward", "backward", "optimizer", "checkpoint"),
        hang_after_s=HANG_AFTER_S if scenario != "slow" else 3 * HANG_AFTER_S,
        heartbeat_interval_s=INTERVAL_S,
        dump_dir=directory,
        timeout_s=600,
    )
    stops = rank == (0 if scenario == "exporter" else 2) and scenario != "slow"
    for step in range(STOP_STEP + 2 if scenario == "slow" else 1_000_000):
        try:
            with telemetry.phase("forward"):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                if stops and step == STOP_STEP and scenario == "forward":
                    _block_in_forward()
                if stops and step == STOP_STEP and scenario == "dies":
                    _die_once_published(telemetry)
                if scenario == "slow":
                    time.sleep(HANG_AFTER_S / 2)  # slow, but moving
            with telemetry.phase("backward"):
                loss.backward()  # DDP's all-reduce: the others wait here for a rank that stopped
            with telemetry.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
                if stops and step == STOP_STEP and scenario == "exporter":
                    _block_in_side_collective(side)
            if scenario == "slow":
                with telemetry.phase("checkpoint"):
                    time.sleep(HANG_AFTER_S)  # a long checkpoint, shorter than hang_after_s
        except RuntimeError:  # a peer died under the all-reduce: wait as a rank under NCCL would
            threading.Event().wait()
        loss_metric.update(loss.detach(), 4)
        telemetry.step(step)
    reads = telemetry._hang_watch.monitor.reads if telemetry.is_exporting else 0
    telemetry.close()
    return reads


def _wait_for(what: str, found: Callable[[], object], procs: list) -> object:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        exited = [proc.exitcode for proc in procs if proc.exitcode not in (None, -signal.SIGKILL)]
        assert not exited, f"a rank exited ({exited}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {DEADLINE_S:.0f} s")


def _hang_report(path: Path, complete: Callable[[dict], bool]) -> dict | None:
    """The latest hang report in the JSONL file that `complete` accepts."""
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            values = json.loads(line)["values"]
        except json.JSONDecodeError:  # the line being written
            continue
        if values.get("train/hang/seconds", 0) > 0:
            return values if complete(values) else None
    return None


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:
        return ""


def _run_until_reported(
    tmp_path: Path, scenario: str, complete: Callable[[dict], bool], scraped: list[str]
) -> dict:
    """Start the ranks; wait for a hang report `complete` accepts in the JSONL file and for the
    `scraped` lines on /metrics, with every rank but a dead one still running; end every rank."""
    port = free_port()
    with started_ranks(_train, WORLD, str(tmp_path), port, scenario) as procs:
        values = _wait_for("hang report", lambda: _hang_report(tmp_path / "metrics.jsonl", complete), procs)
        _wait_for(f"{scraped} on /metrics", lambda: all(line in _scrape(port) for line in scraped), procs)
        running = [proc.is_alive() for proc in procs]
    assert running == [True, True, scenario != "dies"]
    return values


def _series(name: str, value: float, **labels: str) -> str:
    shown = ",".join(
        f'{key}="{label}"' for key, label in sorted({**labels, "route": "scrape", "run": "hang"}.items())
    )
    return f"torchtelemetry_train_hang_{name}{{{shown}}} {value}"


def _stack_file(tmp_path: Path, rank: int) -> str:
    (path,) = tmp_path.glob(f"torchtelemetry-hang-hang-rank{rank}-step{STOP_STEP}.txt")
    return path.read_text()


@pytest.mark.timeout(300)
def test_a_rank_stuck_in_forward_is_named_while_the_others_wait_in_the_all_reduce(tmp_path: Path) -> None:
    lines = [_series("rank", 2.0), _series("step", float(STOP_STEP)), _series("phase", 1.0, phase="forward")]
    values = _run_until_reported(tmp_path, "forward", lambda values: bool(values["train/hang/dump"]), lines)
    assert values["train/hang/rank"] == 2
    assert values["train/hang/step"] == STOP_STEP
    assert values["train/hang/phase"] == {"forward": 1.0}
    assert values["train/hang/lost_ranks"] == 0
    (dump,) = values["train/hang/dump"]
    assert Path(dump) == tmp_path / f"torchtelemetry-hang-hang-rank2-step{STOP_STEP}.txt"
    assert "_block_in_forward" in Path(dump).read_text()
    # The ranks that wait found themselves stuck too: in backward, where DDP's all-reduce is.
    for rank in (0, 1):
        assert "in phase 'backward'" in _stack_file(tmp_path, rank)


@pytest.mark.timeout(300)
def test_the_exporting_rank_reports_while_it_is_itself_blocked_in_a_collective(tmp_path: Path) -> None:
    lines = [_series("rank", 0.0), _series("phase", 1.0, phase="optimizer")]
    values = _run_until_reported(tmp_path, "exporter", lambda values: bool(values["train/hang/dump"]), lines)
    assert values["train/hang/rank"] == 0
    assert values["train/hang/step"] == STOP_STEP
    assert values["train/hang/phase"] == {"optimizer": 1.0}
    assert "_block_in_side_collective" in _stack_file(tmp_path, 0)


@pytest.mark.timeout(300)
def test_a_rank_that_dies_is_counted_lost_and_named(tmp_path: Path) -> None:
    lines = [_series("lost_ranks", 1.0), _series("rank", 2.0)]
    values = _run_until_reported(tmp_path, "dies", lambda values: values["train/hang/lost_ranks"] > 0, lines)
    assert values["train/hang/lost_ranks"] == 1
    assert values["train/hang/rank"] == 2
    assert values["train/hang/phase"] == {"forward": 1.0}


@pytest.mark.timeout(300)
def test_a_run_that_only_slows_down_reports_no_hang(tmp_path: Path) -> None:
    reads = run_ranks(_train, WORLD, str(tmp_path), free_port(), "slow", timeout_s=240)[0]
    assert reads > 0  # the monitor was watching
    reports = [json.loads(line)["values"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert reports and not any(name.startswith("train/hang/") for values in reports for name in values)
    assert not list(tmp_path.glob("torchtelemetry-hang-*"))
