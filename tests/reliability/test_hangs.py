"""A hang is named while it happens: three gloo ranks under DDP, one of them stops, in each ordinary
way a run stops.

Every rank but one waits in a collective (DDP's all-reduce in backward) for a rank that stopped: it
blocks in forward, dies, leaves the loop and closes (uneven inputs), freezes whole (SIGSTOP, a C call
holding the GIL), or is the exporting rank itself. The exporting rank's monitor thread (or, when the
exporting rank froze, the next rank) exports which rank stopped, at which step, in which phase, and
the stack file. The hang lasts until the test ends (far past 5x `hang_after_s`); each test waits on
the values the run reported (bounded), never on the clock, and kills every process it started.
tests/run/test_hang_ordering.py has the exact verdicts on synthetic timelines.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
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
from tests.servers import PrometheusServer, PushgatewayServer

WORLD = 3
STOP_STEP = 3
HANG_AFTER_S = 2.0
INTERVAL_S = 0.2
DEADLINE_S = 120.0
ALERTS = Path(__file__).parents[2] / "exporters" / "prometheus" / "alerts.yml"


def _block_in_forward() -> None:
    threading.Event().wait()  # a deadlock in the data path, a stuck kernel: never returns


def _block_in_side_collective(group: dist.ProcessGroup) -> None:
    dist.barrier(group=group)  # a collective the other ranks never enter


def _freeze() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)  # every thread of the process stops, as a debugger's would


def _hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(3600)  # a C call that keeps the GIL: no other Python thread runs


def _die_once_published(telemetry: tt.Telemetry) -> None:
    publisher = telemetry._hang_watch.publisher
    while publisher.published != publisher.beat.where():  # the monitor knows where it died
        time.sleep(INTERVAL_S / 4)
    os.kill(os.getpid(), signal.SIGKILL)


STOPS = {
    # scenario: (the rank that stops, what it does in forward at STOP_STEP)
    "forward": (2, _block_in_forward),
    "sigstop": (2, _freeze),
    "gil": (2, _hold_the_gil),
    "exporter-sigstop": (0, _freeze),
    "exporter-gil": (0, _hold_the_gil),
}


def _train(rank: int, world_size: int, directory: str, port: int, scenario: str, gateway: str) -> int:
    torch.manual_seed(0)
    if rank == 0:  # the exporting rank's log, read by the test
        handler = logging.FileHandler(Path(directory) / "rank0.log")
        handler.setLevel(logging.WARNING)
        logging.getLogger("torchtelemetry").addHandler(handler)
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    exporters = [tt.JsonlExporter(Path(directory) / "metrics.jsonl"), tt.PrometheusExporter(port=port)]
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        exporters + ([tt.PushgatewayExporter(gateway, job="hangs")] if gateway else []),
        every=2,
        run_id="hang",
        phases=("forward", "backward", "optimizer", "checkpoint"),
        hang_after_s=HANG_AFTER_S if scenario != "slow" else 3 * HANG_AFTER_S,
        heartbeat_interval_s=INTERVAL_S,
        dump_dir=directory,
        timeout_s=600,
    )
    stopping, stop = STOPS.get(scenario, (2, None))
    stops = rank == stopping
    for step in range(STOP_STEP + 2 if scenario == "slow" else 1_000_000):
        if stops and step == STOP_STEP and scenario == "leaves":
            break  # out of data: leaves the loop and closes while the others train on
        try:
            with telemetry.phase("forward"):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                if stops and step == STOP_STEP and stop is not None:
                    stop()
                if stops and step == STOP_STEP and scenario == "dies":
                    _die_once_published(telemetry)
                if scenario == "slow":
                    time.sleep(HANG_AFTER_S / 2)  # slow, but moving
            with telemetry.phase("backward"):
                loss.backward()  # DDP's all-reduce: the others wait here for a rank that stopped
            with telemetry.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
                if rank == 0 and step == STOP_STEP and scenario == "exporter":
                    _block_in_side_collective(side)
            if scenario == "slow":
                with telemetry.phase("checkpoint"):
                    time.sleep(HANG_AFTER_S)  # a long checkpoint, shorter than hang_after_s
        except RuntimeError:  # a peer died under the all-reduce: wait as a rank under NCCL would
            threading.Event().wait()
        loss_metric.update(loss.detach(), 4)
        telemetry.step(step)
    monitor = telemetry._hang_watch.monitor
    reads = monitor.reads if monitor is not None else 0
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


def _hang_reports(path: Path) -> list[dict]:
    """Every hang report in the JSONL file so far (a hang lasting)."""
    if not path.exists():
        return []
    reports = []
    for line in path.read_text().splitlines():
        try:
            values = json.loads(line)["values"]
        except json.JSONDecodeError:  # the line being written
            continue
        if values.get("train/hang/seconds", 0) > 0:
            reports.append(values)
    return reports


def _hang_report(path: Path, complete: Callable[[dict], bool]) -> dict | None:
    """The latest hang report in the JSONL file, if `complete` accepts it."""
    reports = _hang_reports(path)
    return reports[-1] if reports and complete(reports[-1]) else None


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:
        return ""


def _run_until_reported(
    tmp_path: Path, scenario: str, complete: Callable[[dict], bool], scraped: list[str], alive: list[bool]
) -> tuple[dict, list[dict]]:
    """Start the ranks; wait for a hang report `complete` accepts in the JSONL file and for the
    `scraped` lines on /metrics; check which ranks still run (`alive`); end every rank. Returns that
    report and every hang report of the run."""
    port = free_port()
    with started_ranks(_train, WORLD, str(tmp_path), port, scenario, "") as procs:
        path = tmp_path / "metrics.jsonl"
        values = _wait_for("hang report", lambda: _hang_report(path, complete), procs)
        _wait_for(f"{scraped} on /metrics", lambda: all(line in _scrape(port) for line in scraped), procs)
        running = [proc.is_alive() for proc in procs]
        reports = _hang_reports(path)
    assert running == alive
    return values, reports


def _series(name: str, value: float, **labels: str) -> str:
    shown = ",".join(
        f'{key}="{label}"' for key, label in sorted({**labels, "route": "scrape", "run": "hang"}.items())
    )
    return f"torchtelemetry_train_hang_{name}{{{shown}}} {value}"


def _capture(tmp_path: Path, rank: int) -> Path:
    """The hang capture of `rank`, stuck at STOP_STEP (its stacks: `stacks.txt`)."""
    return tmp_path / f"torchtelemetry-capture-hang-rank{rank}-step{STOP_STEP}-hang"


def _stack_file(tmp_path: Path, rank: int) -> str:
    return (_capture(tmp_path, rank) / "stacks.txt").read_text()


@pytest.mark.timeout(300)
def test_a_rank_stuck_in_forward_is_named_while_the_others_wait_in_the_all_reduce(tmp_path: Path) -> None:
    lines = [_series("rank", 2.0), _series("step", float(STOP_STEP)), _series("phase", 1.0, phase="forward")]
    values, _ = _run_until_reported(
        tmp_path, "forward", lambda values: bool(values["train/hang/dump"]), lines, [True] * 3
    )
    assert values["train/hang/rank"] == 2
    assert values["train/hang/step"] == STOP_STEP
    assert values["train/hang/phase"] == {"forward": 1.0}
    assert values["train/hang/lost_ranks"] == 0
    (dump,) = values["train/hang/dump"]
    assert Path(dump) == _capture(tmp_path, 2) / "stacks.txt"  # the stacks are the hang's capture
    assert values["train/capture/file"] == {str(_capture(tmp_path, 2)): 1.0}
    assert (values["train/capture/rank"], values["train/capture/step"]) == (2, STOP_STEP)
    assert "_block_in_forward" in Path(dump).read_text()
    # The ranks that wait found themselves stuck too: in backward, where DDP's all-reduce is.
    for rank in (0, 1):
        assert "in phase 'backward'" in _stack_file(tmp_path, rank)


@pytest.mark.timeout(300)
def test_the_exporting_rank_reports_while_it_is_itself_blocked_in_a_collective(tmp_path: Path) -> None:
    lines = [_series("rank", 0.0), _series("phase", 1.0, phase="optimizer")]
    values, _ = _run_until_reported(
        tmp_path, "exporter", lambda values: bool(values["train/hang/dump"]), lines, [True] * 3
    )
    assert values["train/hang/rank"] == 0
    assert values["train/hang/step"] == STOP_STEP
    assert values["train/hang/phase"] == {"optimizer": 1.0}
    assert "_block_in_side_collective" in _stack_file(tmp_path, 0)


@pytest.mark.timeout(300)
def test_a_rank_that_dies_is_counted_lost_and_named(tmp_path: Path) -> None:
    lines = [_series("lost_ranks", 1.0), _series("rank", 2.0)]
    values, _ = _run_until_reported(
        tmp_path, "dies", lambda values: values["train/hang/lost_ranks"] > 0, lines, [True, True, False]
    )
    assert values["train/hang/lost_ranks"] == 1
    assert values["train/hang/rank"] == 2
    assert values["train/hang/phase"] == {"forward": 1.0}


@pytest.mark.timeout(300)
def test_a_rank_that_left_the_loop_is_named_closed_for_the_whole_hang_and_logged_once(tmp_path: Path) -> None:
    """Uneven inputs: rank 2 runs out of data at STOP_STEP and calls close() (its final collection
    waits for the others) while ranks 0 and 1 wait in the all-reduce of STOP_STEP. Rank 2 is named,
    in phase closed, with its own stack file (it shows close()), in every report of the hang."""
    lines = [_series("rank", 2.0), _series("phase", 1.0, phase="closed")]
    values, reports = _run_until_reported(
        tmp_path, "leaves", lambda values: values["train/hang/seconds"] >= 4 * HANG_AFTER_S, lines, [True] * 3
    )
    assert {(r["train/hang/rank"], r["train/hang/step"], *r["train/hang/phase"]) for r in reports} == {
        (2, STOP_STEP, "closed")
    }
    (dump,) = values["train/hang/dump"]
    assert Path(dump) == _capture(tmp_path, 2) / "stacks.txt"
    assert "in phase 'closed'" in Path(dump).read_text() and "in close" in Path(dump).read_text()
    log = (tmp_path / "rank0.log").read_text()
    assert log.count("Telemetry: hang:") == 1, log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["sigstop", "gil"])
def test_a_frozen_rank_is_named_lost_at_the_step_the_others_wait_in(tmp_path: Path, scenario: str) -> None:
    """SIGSTOP, or a C call holding the GIL, in forward: the rank stops publishing (its last
    heartbeat may be steps old). It is named at the step the others wait in, in the phase it was
    last seen entering there or `unknown`, never its stale step."""
    lines = [_series("rank", 2.0), _series("step", float(STOP_STEP)), _series("lost_ranks", 1.0)]
    values, reports = _run_until_reported(
        tmp_path, scenario, lambda values: values["train/hang/lost_ranks"] > 0, lines, [True] * 3
    )
    assert (values["train/hang/rank"], values["train/hang/step"]) == (2, STOP_STEP)
    assert set(values["train/hang/phase"]) <= {"forward", "unknown"}
    assert all(report["train/hang/step"] == STOP_STEP for report in reports if report["train/hang/rank"] == 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["exporter-sigstop", "exporter-gil"])
def test_a_frozen_exporting_rank_is_reported_by_the_next_rank_and_rank_hung_fires(
    tmp_path: Path, scenario: str
) -> None:
    """The exporting rank freezes in forward: its monitor and exporters freeze with it. Rank 1, which
    watches its heartbeat and waits for it in the all-reduce, reports it through a Pushgateway group
    of its own (reporter="rank1") and a stack file in dump_dir; Prometheus, scraping the gateway,
    evaluates RankHung's expression to the run."""
    yaml = pytest.importorskip("yaml")  # not on the GPU image, whose gpu-check imports this module
    rank_hung = next(
        rule["expr"]
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
        if rule.get("alert") == "RankHung"
    )
    with (
        PushgatewayServer(tmp_path / "gateway") as gateway,
        PrometheusServer(tmp_path / "prometheus") as prometheus,
    ):
        prometheus.scrape("pushgateway", [gateway.address], honor_labels=True)
        with started_ranks(_train, WORLD, str(tmp_path), free_port(), scenario, gateway.url) as procs:
            reported = 'torchtelemetry_train_hang_rank{reporter="rank1", run="hang"}'
            _wait_for("the next rank's report", lambda: prometheus.query(reported), procs)
            named = {
                name: prometheus.query(f'torchtelemetry_train_hang_{name}{{reporter="rank1", run="hang"}}')
                for name in ("rank", "step", "lost_ranks")
            }
            firing = prometheus.wait_for(rank_hung, timeout_s=DEADLINE_S)
            running = [proc.is_alive() for proc in procs]
    assert running == [True, True, True]
    assert {name: [sample.value for sample in samples] for name, samples in named.items()} == {
        "rank": [0.0],
        "step": [float(STOP_STEP)],
        "lost_ranks": [1.0],
    }
    assert [(sample.labels["job"], sample.labels["run"]) for sample in firing] == [("hangs", "hang")]
    (evidence,) = tmp_path.glob(f"torchtelemetry-hang-hang-rank0-step{STOP_STEP}-seen-by-rank1-1.txt")
    text = evidence.read_text()
    assert "rank 1 reports the exporting rank 0" in text and "in phase 'backward'" in text


@pytest.mark.timeout(300)
def test_a_run_that_only_slows_down_reports_no_hang(tmp_path: Path) -> None:
    reads = run_ranks(_train, WORLD, str(tmp_path), free_port(), "slow", "", timeout_s=240)[0]
    assert reads > 0  # the monitor was watching
    reports = [json.loads(line)["values"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert reports and not any(name.startswith("train/hang/") for values in reports for name in values)
    assert not list(tmp_path.glob("torchtelemetry-hang-*")) and not list(
        tmp_path.glob("torchtelemetry-capture-*")
    )


def _stuck_alone(rank: int, world_size: int, directory: str) -> tuple[str, list[str]]:
    """No run id given: every rank starts with one of its own, then takes rank 0's. Rank 1 is stuck
    in forward until its hang capture is written."""
    telemetry = tt.Telemetry(
        {"loss": tt.SumMetric()},
        hang_after_s=HANG_AFTER_S,
        heartbeat_interval_s=INTERVAL_S,
        dump_dir=directory,
    )
    telemetry.step(0)
    if rank == 1:
        with telemetry.phase("forward"):
            deadline = time.monotonic() + DEADLINE_S
            while (
                not list(Path(directory).glob("torchtelemetry-capture-*-rank1-*/stacks.txt"))
                and time.monotonic() < deadline
            ):
                time.sleep(INTERVAL_S)
    telemetry.step(1)
    run_id = telemetry.run.run_id
    telemetry.close()
    captures = Path(directory).glob("torchtelemetry-capture-*-rank1-*")
    return run_id, sorted(path.name for path in captures)


@pytest.mark.timeout(300)
def test_every_rank_names_its_hang_capture_with_the_run_id_the_ranks_agreed_on(tmp_path: Path) -> None:
    env = {"TORCHTELEMETRY_RUN_ID": "", "TORCHELASTIC_RUN_ID": "", "SLURM_JOB_ID": ""}
    (run_id, files), (same, _) = run_ranks(_stuck_alone, 2, str(tmp_path), env=env, timeout_s=240)
    assert run_id == same
    assert files == [f"torchtelemetry-capture-{run_id}-rank1-step1-hang"]
    assert f"run {run_id} rank 1" in (tmp_path / files[0] / "stacks.txt").read_text()
