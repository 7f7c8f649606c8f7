"""Goodput and the progress file (issue 31): left out until a checkpoint is durable, read from the
monotonic-anchored clock, one restart per launch, and a progress file that is only ever taken as
the library wrote it, written off every thread that matters for training."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from torchtelemetry.run import GoodputLedger, ProgressFile, ProgressRecord, progress_path

GOODPUT_LOGGER = "torchtelemetry.run"


def _telemetry(progress: Path | None, **fields: Any) -> tt.Telemetry:
    return tt.Telemetry(
        {"train": {"loss": tt.WeightedMeanMetric()}}, progress_file=progress, **{"every": 1, **fields}
    )


def _train(telemetry: tt.Telemetry, steps: range) -> None:
    for step in steps:
        telemetry.metrics["train"]["loss"].update(torch.tensor(float(step)), 1)
        telemetry.step(step)
    telemetry.flush()


def test_goodput_is_left_out_until_a_checkpoint_is_durable() -> None:
    with _telemetry(None, run_id="never") as telemetry:
        _train(telemetry, range(3))
        assert "train/goodput" not in telemetry.latest
        assert "train/goodput/wall_time" not in telemetry.latest
        assert telemetry.latest["train/goodput/restarts"] == 0
        telemetry.checkpoint_saved(2)
        _train(telemetry, range(3, 5))
        assert 0 < telemetry.latest["train/goodput"] <= 1


def test_goodput_reads_the_clock_of_every_timestamp_not_the_system_clock(monkeypatch) -> None:
    goodput = GoodputLedger(None)
    goodput.checkpoint_saved(0)
    # The system clock set an hour forward (NTP, an operator): the run did not get an hour older.
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    reading = goodput.reading()
    assert reading.wall_s is not None and reading.productive_s is not None
    assert reading.wall_s < 600 and reading.productive_s <= reading.wall_s
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    later = goodput.reading().wall_s
    assert later is not None and later >= reading.wall_s


def _write_progress(path: Path, run_id: str, step: int) -> None:
    path.write_text(json.dumps({"run_id": run_id, "step": step}))


def _saved(tmp_path: Path, run_id: str, steps: int) -> dict[str, Any]:
    """A checkpoint taken after `steps` steps of run `run_id` (a partial window of one step)."""
    with _telemetry(None, run_id=run_id, every=3) as telemetry:
        _train(telemetry, range(steps))
        telemetry.metrics["train"]["loss"].update(torch.tensor(1.0), 1)
        telemetry.step(steps)  # in the partial window the checkpoint keeps
        state = telemetry.state_dict()
        telemetry.checkpoint_saved(steps)
    return state


def test_load_state_dict_twice_counts_one_restart(tmp_path: Path) -> None:
    progress = tmp_path / "progress.json"
    state = _saved(tmp_path, "twice", 9)
    _write_progress(progress, "twice", 15)  # the killed attempt got 6 steps past the checkpoint
    with _telemetry(progress) as telemetry:
        telemetry.load_state_dict(state)  # a resume helper,
        telemetry.load_state_dict(state)  # then the framework
        assert telemetry.run_identity == tt.RunIdentity("twice", "progress_file")
        _train(telemetry, range(10, 12))
        assert telemetry.latest["train/goodput/restarts"] == 1
        assert telemetry.latest["train/goodput/recomputed_steps"] == 6


BAD_PROGRESS = {
    "a list": "[]",
    "null": "null",
    "a number": "5",
    "no step": json.dumps({"run_id": "bad"}),
    "a string step": json.dumps({"run_id": "bad", "step": "ten"}),
    "a huge float step": json.dumps({"run_id": "bad", "step": 1e400}),
    "a string finished": json.dumps({"run_id": "bad", "step": 20, "finished": "yes"}),
    "another run": json.dumps({"run_id": "someone-else", "step": 20}),
    "garbage": "\x00\xff{not json",
}


@pytest.mark.parametrize("content", list(BAD_PROGRESS.values()), ids=list(BAD_PROGRESS))
def test_a_progress_file_the_library_did_not_write_is_logged_once_and_the_resume_goes_on(
    tmp_path: Path, caplog, content: str
) -> None:
    progress = tmp_path / "progress.json"
    state = _saved(tmp_path, "bad", 9)
    progress.write_text(content)
    with caplog.at_level(logging.WARNING, logger=GOODPUT_LOGGER), _telemetry(progress) as telemetry:
        telemetry.load_state_dict(state)
        assert telemetry.run_identity.run_id == "bad"
        # The window bookkeeping was restored: the partial window (step 9) closes with step 10.
        telemetry.metrics["train"]["loss"].update(torch.tensor(3.0), 1)
        telemetry.step(10)
        telemetry.flush()
        assert telemetry.latest_step == 10
        assert telemetry.latest["train/loss"] == pytest.approx(2.0)  # (1 + 3) / 2: nothing lost
        assert telemetry.latest["train/goodput/restarts"] == 1
        assert telemetry.latest["train/goodput/recomputed_steps"] == 0
        assert telemetry.latest["train/goodput"] > 0  # the checkpoint's productive time came back
    warned = [record for record in caplog.records if "progress_file" in record.getMessage()]
    assert len(warned) == 1, [record.getMessage() for record in warned]


def test_a_planted_partial_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    progress = tmp_path / "progress.json"
    (tmp_path / "progress.json.partial").symlink_to(target)
    writer = ProgressFile(progress)
    writer.write(ProgressRecord("run", 4))
    writer.close()
    assert target.read_text() == "keep me"
    assert writer.read() == ProgressRecord("run", 4)
    assert not (tmp_path / "progress.json.partial").exists()


def test_a_fifo_as_progress_file_is_not_read_and_blocks_nothing(tmp_path: Path, caplog) -> None:
    progress = tmp_path / "progress.json"
    os.mkfifo(progress)
    with caplog.at_level(logging.WARNING, logger=GOODPUT_LOGGER), _telemetry(progress) as telemetry:
        assert telemetry.run_identity.source != "progress_file"
        _train(telemetry, range(3))
    assert "not a regular file" in caplog.text
    # Replaced by the first write, and the run's end recorded by close().
    assert ProgressFile(progress).read() == ProgressRecord(telemetry.run.run_id, 2, finished=True)


def test_step_returns_while_the_progress_write_is_stuck_in_a_hung_file_system(tmp_path: Path) -> None:
    """A FIFO no one reads stands for a hung NFS mount: opening it for writing blocks until a reader
    comes. Every window's write is handed to the writer thread, so `step()` goes on (more windows
    than the collector holds in flight, each waiting on the write under the old design) while that
    open is provably still blocked."""
    fifo = tmp_path / "hung"
    os.mkfifo(fifo)
    entered, returned = threading.Event(), threading.Event()

    def hung_open(name: str, flags: int) -> int:
        entered.set()
        descriptor = os.open(fifo, os.O_WRONLY)  # blocks: nobody reads the FIFO yet
        returned.set()
        return descriptor

    telemetry = _telemetry(tmp_path / "progress.json", run_id="hung")
    assert telemetry._progress is not None
    telemetry._progress.file._opener = hung_open
    try:
        _train(telemetry, range(2))
        assert entered.wait(60), "the first window's write never started"
        _train(telemetry, range(2, 4 * telemetry.max_pending + 2))
        assert not returned.is_set()  # every step() and flush() returned while the write hung
        assert telemetry.latest_step == 4 * telemetry.max_pending + 1
    finally:
        with open(fifo, "rb"):  # the file system comes back
            assert returned.wait(60)
        telemetry.close()


def test_each_group_writes_its_own_progress_file(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    assert progress_path(path, "") == path
    assert progress_path(path, "-group2") == tmp_path / "progress-group2.json"


def test_close_exports_the_goodput_of_a_checkpoint_saved_after_the_last_window(tmp_path: Path) -> None:
    """A checkpoint saved after the last window (its state taken at that window's step, as
    `torch.distributed.checkpoint.save` takes it, then marked durable) never reached an exported
    report: the final goodput left out the last checkpoint (0.166 against 0.199 with it)."""
    out = tmp_path / "run.jsonl"
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    telemetry = tt.Telemetry(metrics, [tt.JsonlExporter(out)], every=2, run_id="late")
    for step in range(4):  # windows end at steps 1 and 3
        metrics["train"]["loss"].update(torch.tensor(1.0), 1)
        telemetry.step(step)
        if step in (1, 3):
            telemetry.state_dict()
            telemetry.checkpoint_saved(step)
    telemetry.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    window_3 = next(record for record in records if record["step"] == 3)
    final = records[-1]
    assert final["step"] == 3
    productive = "train/goodput/productive_time"
    assert final["values"][productive] > window_3["values"][productive] > 0  # step 3's checkpoint counts
    assert final["values"][productive] == telemetry.latest[productive]
    assert final["values"]["train/goodput"] == telemetry.latest["train/goodput"]
    assert final["values"]["train/loss"] == window_3["values"]["train/loss"]  # the rest as it was
