"""A verdict brings its evidence, end to end on real gloo ranks: the rank a verdict names (and, for a
straggler, the median rank of its phase) profiles its next steps into a capture directory of its own,
and the run exports the directory.

The straggler sleeps 0.25 s a step in its forward, over ten times the step's own work; these tests
assert only what that margin guarantees (the slow rank is named and captured, never another), never
a time. Which verdicts trigger, in what order and within which bound is decided on synthetic verdicts
(test_capture_desk.py).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import parser as prometheus_parser
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.servers import http_get

DELAY_S = 0.25
"""The straggler's sleep per step in its forward: over ten times the step's own work."""
PREFIX = "torchtelemetry-capture-"


def _warnings() -> list[str]:
    """The torchtelemetry warnings this process logs from now on."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtelemetry").addHandler(handler)
    return warnings


def _scraped(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The capture samples of a scrape: name -> [(labels, value)]."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if "capture" in sample.name:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _reports(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["values"] for line in path.read_text().splitlines()]


def _captures(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob(f"{PREFIX}*"))


# -- a straggler ---------------------------------------------------------------------------------


def _straggle(rank: int, world_size: int, directory: str, slow: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    prometheus = tt.PrometheusExporter(port=0, linger_s=0)
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.JsonlExporter(Path(directory) / "metrics.jsonl"), prometheus],
        every=3,
        run_id="slow",
        dump_dir=directory,
        max_captures=1,  # the profile slows the ranks it runs on: no capture of that
        nvml=False,
    )
    telemetry.watch_gradient_sync(model)
    for step in range(42):
        with telemetry.data_wait():
            batch = torch.randn(32, 64)
        with telemetry.phase("forward"):
            loss = model(batch).pow(2).mean()
            if rank == slow:
                time.sleep(DELAY_S)
        with telemetry.phase("backward"):
            loss.backward()  # the other ranks wait here for the slow one
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        loss_metric.update(loss.detach(), 32)
        telemetry.step(step)
    telemetry.flush()
    scraped = http_get(prometheus.url).decode() if telemetry.is_exporting else ""
    telemetry.close()
    return {"scraped": scraped}


@pytest.mark.timeout(300)
def test_a_straggler_is_captured_on_its_rank_and_on_one_reference_rank(tmp_path: Path) -> None:
    scraped = run_ranks(_straggle, 3, str(tmp_path), 2, timeout_s=240)[0]["scraped"]
    reports = _reports(tmp_path / "metrics.jsonl")
    named = [name for name in _captures(tmp_path) if name.endswith("-straggler")]
    references = [name for name in _captures(tmp_path) if name.endswith("-straggler-reference")]
    assert len(named) == 1 and named[0].startswith(f"{PREFIX}slow-rank2-step"), _captures(tmp_path)
    (reference,) = references
    step = named[0].removeprefix(f"{PREFIX}slow-rank2-step").removesuffix("-straggler")
    assert reference in {f"{PREFIX}slow-rank{rank}-step{step}-straggler-reference" for rank in (0, 1)}
    assert set(_captures(tmp_path)) == {named[0], reference}  # nothing of the third rank
    for name in (named[0], reference):
        capture = tmp_path / name
        assert {path.name for path in capture.iterdir()} == {"trace.json", "stacks.txt"}
        assert all(path.stat().st_mode & 0o777 == 0o600 for path in capture.iterdir())
        assert capture.stat().st_mode & 0o777 == 0o700
        events = {
            event.get("name") for event in json.loads((capture / "trace.json").read_text())["traceEvents"]
        }
        assert {f"ProfilerStep#{n}" for n in range(5)} <= events  # the profiled steps
        assert "aten::addmm" in events and "aten::mean" in events  # the forward's ops among them
        assert "Python stacks of every thread" in (capture / "stacks.txt").read_text()
    last = reports[-1]
    directory = str(tmp_path / named[0])
    assert (last["train/capture/rank"], last["train/capture/step"]) == (2, int(step))
    assert last["train/capture/file"] == {directory: 1.0}
    assert last["train/capture/count"]["straggler"] >= 1 and last["train/capture/count"]["failed"] == 0
    samples = _scraped(scraped)
    assert [value for _, value in samples["torchtelemetry_train_capture_rank"]] == [2.0]
    assert [labels["file"] for labels, _ in samples["torchtelemetry_train_capture_file"]] == [directory]


# -- a non-finite value ------------------------------------------------------------------------------

NAN_STEP = 4


def _feed_nan(rank: int, world_size: int, directory: str) -> None:
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.JsonlExporter(Path(directory) / "metrics.jsonl")],
        every=2,
        run_id="nan",
        dump_dir=directory,
        nvml=False,
    )
    for step in range(24):
        loss = torch.tensor(float("nan") if (rank, step) == (1, NAN_STEP) else 1.0)
        loss_metric.update(loss, 1)
        telemetry.step(step)
    telemetry.close()


@pytest.mark.timeout(300)
def test_a_non_finite_value_is_captured_on_the_rank_that_saw_it_first_only(tmp_path: Path) -> None:
    run_ranks(_feed_nan, 3, str(tmp_path), timeout_s=240)
    (name,) = _captures(tmp_path)
    assert name.startswith(f"{PREFIX}nan-rank1-step") and name.endswith("-nonfinite"), name
    step = int(name.removeprefix(f"{PREFIX}nan-rank1-step").removesuffix("-nonfinite"))
    assert step > NAN_STEP  # after the window that saw it, carried by a later one
    assert {path.name for path in (tmp_path / name).iterdir()} == {"trace.json", "stacks.txt"}
    last = _reports(tmp_path / "metrics.jsonl")[-1]
    assert last["train/capture/count"]["nonfinite"] == 1 and last["train/nonfinite/first_rank"]
    assert (last["train/capture/rank"], last["train/capture/step"]) == (1, step)
    assert last["train/capture/file"] == {str(tmp_path / name): 1.0}


# -- requests, the bound, failures -------------------------------------------------------------------

REQUESTS = {3: 0, 5: 1}
"""step -> the rank the exporting rank asks a capture of, before that step's `step()`. The first
rides the window ending at step 3 (every=2: windows end at odd steps), read by every rank when it is
collected, begun when the window max_pending (2) later is scheduled: after step 7. The second leaves
once the first settled: the window after it began carries its outcome, collected at the latest when
the window two later is scheduled, whose flush sends the second; it begins two windows later still,
by step 17."""
STEPS = 24
BEGUN = "torchtelemetry-capture-ask-rank0-step7-request"


def _request(rank: int, world_size: int, directory: str, dump_dir: str, fields: dict[str, Any]) -> dict:
    warnings = _warnings()
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.JsonlExporter(Path(directory) / "metrics.jsonl")],
        every=2,
        run_id="ask",
        dump_dir=dump_dir,
        nvml=False,
        **fields,
    )
    refused = ""
    if not telemetry.is_exporting:
        try:
            telemetry.request_capture(0)
        except RuntimeError as error:
            refused = str(error)
    for step in range(STEPS):
        loss_metric.update(torch.tensor(1.0), 1)
        if telemetry.is_exporting and step in REQUESTS:  # from a callback's thread on the exporting rank
            asking = threading.Thread(target=telemetry.request_capture, args=(REQUESTS[step],))
            asking.start()
            asking.join()
        telemetry.step(step)
    telemetry.close()
    return {"warnings": [w for w in warnings if "capture" in w], "refused": refused, "steps": step + 1}


@pytest.mark.timeout(300)
def test_requests_beyond_max_captures_are_counted_not_captured(tmp_path: Path) -> None:
    results = run_ranks(_request, 2, str(tmp_path), str(tmp_path), {"max_captures": 1}, timeout_s=240)
    assert _captures(tmp_path) == [BEGUN]  # rank 0's, asked first; rank 1's was beyond the bound
    assert {path.name for path in (tmp_path / BEGUN).iterdir()} == {"trace.json", "stacks.txt"}
    last = _reports(tmp_path / "metrics.jsonl")[-1]
    assert last["train/capture/count"]["request"] == 2 and last["train/capture/count"]["failed"] == 0
    assert last["train/capture/file"] == {str(tmp_path / BEGUN): 1.0}
    assert "does not export" in results[1]["refused"]
    assert any("max_captures=1" in warning for warning in results[0]["warnings"])


@pytest.mark.timeout(300)
def test_a_symlink_planted_at_the_directory_is_never_followed_and_training_goes_on(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / BEGUN).symlink_to(victim)
    results = run_ranks(_request, 2, str(tmp_path), str(tmp_path), {"max_captures": 1}, timeout_s=240)
    assert not list(victim.iterdir()) and (tmp_path / BEGUN).is_symlink()
    assert [result["steps"] for result in results] == [STEPS, STEPS]
    last = _reports(tmp_path / "metrics.jsonl")[-1]
    assert last["train/capture/count"] == {
        "straggler": 0.0,
        "nonfinite": 0.0,
        "hang": 0.0,
        "request": 2.0,
        "failed": 1.0,
    }
    assert last["train/capture/file"] == {}  # no directory is named for a capture that failed
    (warning,) = results[0]["warnings"][1:]  # after the bound's
    assert BEGUN in warning and "File exists" in warning and "training goes on" in warning


@pytest.mark.timeout(300)
def test_an_unwritable_dump_dir_fails_the_capture_once_and_training_goes_on(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    results = run_ranks(_request, 2, str(tmp_path), str(not_a_directory), {}, timeout_s=240)
    assert [result["steps"] for result in results] == [STEPS, STEPS]
    last = _reports(tmp_path / "metrics.jsonl")[-1]
    assert last["train/capture/count"]["request"] == 2 and last["train/capture/count"]["failed"] == 2
    assert len(results[0]["warnings"]) == 1 and len(results[1]["warnings"]) == 1  # one each, per capture
    assert "could not write" in results[0]["warnings"][0]


def test_a_profiler_already_running_is_left_alone_and_the_capture_fails_once(tmp_path: Path) -> None:
    """A rank where the user profiles (torch.profiler is one per process) does not start a second one:
    the user's profile keeps every op, the capture counts as failed, training goes on."""
    warnings = _warnings()
    model = torch.nn.Linear(8, 8)
    loss_metric = tt.WeightedMeanMetric()
    with (
        tt.Telemetry(
            {"train": {"loss": loss_metric}}, every=2, run_id="mine", dump_dir=tmp_path
        ) as telemetry,
        torch.profiler.profile() as users,
    ):
        for step in range(STEPS):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss_metric.update(loss.detach(), 4)
            if step in REQUESTS:
                telemetry.request_capture(0)
            telemetry.step(step)
    assert sum(event.name == "aten::addmm" for event in users.events()) == STEPS
    assert telemetry.latest["train/capture/count"]["failed"] == 2
    assert telemetry.latest["train/capture/file"] == {}
    captures = _captures(tmp_path)  # each keeps the stacks written when it began
    assert len(captures) == 2 and "torchtelemetry-capture-mine-rank0-step7-request" in captures
    for name in captures:
        assert [path.name for path in (tmp_path / name).iterdir()] == ["stacks.txt"]
    failures = [warning for warning in warnings if "a profiler is already running" in warning]
    assert len(failures) == 2


def test_without_dump_dir_captures_go_where_the_environment_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job spec's `TORCHTELEMETRY_DUMP_DIR` stands in for `dump_dir` (else the current directory)."""
    monkeypatch.setenv("TORCHTELEMETRY_DUMP_DIR", str(tmp_path / "evidence"))
    monkeypatch.chdir(tmp_path)
    loss_metric = tt.WeightedMeanMetric()
    with tt.Telemetry({"train": {"loss": loss_metric}}, every=2, run_id="env", nvml=False) as telemetry:
        for step in range(8):
            loss_metric.update(torch.tensor(1.0), 1)
            if step == 3:
                telemetry.request_capture(0)
            telemetry.step(step)
    assert _captures(tmp_path) == []
    assert _captures(tmp_path / "evidence") == ["torchtelemetry-capture-env-rank0-step7-request"]


def test_a_verdict_of_the_last_window_is_counted_in_the_final_report(tmp_path: Path) -> None:
    """A NaN in the last window triggers a capture no step is left to take: the trigger still counts
    (no window follows to carry it, so close() exports it), and nothing is captured."""
    loss_metric = tt.WeightedMeanMetric()
    with tt.Telemetry(
        {"train": {"loss": loss_metric}}, every=2, run_id="late", dump_dir=tmp_path, nvml=False
    ) as telemetry:
        for step in range(4):
            loss_metric.update(torch.tensor(math.nan if step == 3 else 1.0), 1)
            telemetry.step(step)
    assert telemetry.latest["train/capture/count"]["nonfinite"] == 1
    assert _captures(tmp_path) == []
