"""Distributed faults at the `Telemetry` level, on real gloo ranks: every rank gets a clear error
within the configured timeout, `close()` returns, and no thread or process is left behind.

The collector-level cases live in tests/collect/test_collector_failures.py; these run the whole
façade (the collector, the rank-0 hub and a real JSONL exporter) through the same faults.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.collect import CollectionError
from torchtelemetry.sync import LayoutMismatchError

TIMEOUT_S = 3.0
EVERY = 2
# Generous bound for "returned instead of hanging" on a slow, shared CI machine: not a speed check.
NOT_A_HANG_S = TIMEOUT_S + 60
THREAD_PREFIX = "torchtelemetry-"


def _child_processes() -> list[int]:
    """Pids whose parent is this process (a leaked worker would show up here)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # exited while listing
            continue
        if int(fields[1]) == os.getpid():
            children.append(int(entry))
    return children


def _error(error: BaseException, started: float) -> dict[str, Any]:
    return {
        "type": type(error).__name__,
        "message": str(error),
        "cause": type(error.__cause__).__name__ if error.__cause__ is not None else None,
        "elapsed_s": time.monotonic() - started,
    }


def _close(telemetry: tt.Telemetry, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Close after a fault: how long it took, what it raised, and what it left running (`timeout_s`:
    close's bound on its last window)."""
    started = time.monotonic()
    outcome: dict[str, Any] = {"close_error": None}
    try:
        telemetry.close(timeout_s=timeout_s)
    except CollectionError as error:
        outcome["close_error"] = _error(error, started)
    outcome["close_s"] = time.monotonic() - started
    outcome["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
    outcome["children"] = _child_processes()
    with pytest.raises(RuntimeError, match="telemetry is closed"):
        telemetry.step(10_000)
    return outcome


def _train(telemetry: tt.Telemetry, metrics: dict[str, tt.Metric], steps: range) -> dict[str, Any] | None:
    """Step through `steps`; the first error as an outcome, or None if every step returned."""
    started = time.monotonic()
    for step in steps:
        metrics["loss"].update(torch.tensor(float(step)))
        try:
            telemetry.step(step)
        except CollectionError as error:
            return {**_error(error, started), "step": step}
        time.sleep(0.01)
    return None


def _exported_steps(path: str) -> list[int]:
    return [json.loads(line)["step"] for line in Path(path).read_text().splitlines()]


# -- a rank that stops calling step() ---------------------------------------------------------


def _stalled_rank(rank: int, world_size: int, path: str) -> dict[str, Any]:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(
        metrics, [tt.JsonlExporter(path)], every=EVERY, timeout_s=TIMEOUT_S, signals=False
    )
    # Both ranks finish windows 0 and 1 (steps 0-3); then rank 1 stops in the middle of window 2
    # (a stuck data loader, a rank in another code path) while rank 0 trains on.
    first = _train(telemetry, metrics, range(4))
    assert first is None, first
    error = _train(telemetry, metrics, range(4, 200) if rank == 0 else range(4, 5))
    dist.barrier()  # rank 1 comes back only after rank 0 has given up
    return {"error": error, **_close(telemetry)}


@pytest.mark.timeout(180)
def test_a_rank_that_stops_stepping_gives_every_rank_a_clear_error_and_close_returns(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.jsonl")
    training, stalled = run_ranks(_stalled_rank, 2, path, timeout_s=150)

    error = training["error"]
    assert error is not None, "rank 0 trained on although rank 1 stopped scheduling collections"
    assert error["type"] == "CollectionError"
    assert "a rank may have died or not called schedule_collection() within timeout_s=3s" in error["message"]
    assert error["elapsed_s"] < NOT_A_HANG_S
    assert stalled["error"] is None  # rank 1 never waited on anything while it was away
    # The stalled rank learns it on close(): its last window has no partner any more.
    assert stalled["close_error"] is not None
    assert "collector's process group (ranks [0, 1]) failed" in stalled["close_error"]["message"]
    for outcome in (training, stalled):
        assert outcome["close_s"] < NOT_A_HANG_S
        assert outcome["threads"] == [] and outcome["children"] == []
    # What was collected before the fault was exported, in order.
    assert _exported_steps(path)[:2] == [1, 3]


# -- ranks with different metric sets -----------------------------------------------------------


def _mismatched_rank(rank: int, world_size: int, path: str, case: str) -> dict[str, Any]:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    if case == "extra metric" and rank == 1:
        metrics["grad_norm"] = tt.MaxMetric()
    if case == "other shape":
        metrics["confusion"] = tt.ConfusionMatrixMetric(3 + rank)
    if case == "other bins":  # same count, other bounds: the shapes agree, the meaning does not
        metrics["grad_norm"] = tt.HistogramMetric([1.0, 2.0, 3.0] if rank == 0 else [100.0, 200.0, 300.0])
    if case == "other top_k":
        metrics["accuracy"] = tt.AccuracyMetric(top_k=1 if rank == 0 else 3)
    if case == "counter and gauge":
        metrics["tokens"] = tt.SumMetric(kind="counter" if rank == 0 else "gauge")
    started = time.monotonic()
    error = None
    try:  # the collector checks the layout at bind(), inside Telemetry(): before any training step
        telemetry = tt.Telemetry(
            metrics, [tt.JsonlExporter(path)], every=EVERY, timeout_s=TIMEOUT_S, signals=False
        )
        telemetry.close()
    except LayoutMismatchError as raised:
        error = _error(raised, started)
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
    return {"error": error, "threads": threads, "children": _child_processes()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("extra metric", "rank 1 lacks [] and has extra ['grad_norm.extremum'] vs rank 0"),
        (
            "other shape",
            "'confusion.matrix' is sum:torch.float64:[3, 3] on rank 0 but sum:torch.float64:[4, 4] on rank 1",
        ),
        (
            "other bins",
            "'grad_norm' has bins=[1.0, 2.0, 3.0] on rank 0 but bins=[100.0, 200.0, 300.0] on rank 1",
        ),
        ("other top_k", "'accuracy' has top_k=1 on rank 0 but top_k=3 on rank 1"),
        ("counter and gauge", "'tokens' has kind='counter' on rank 0 but kind='gauge' on rank 1"),
    ],
)
def test_ranks_with_different_metric_sets_fail_on_every_rank_naming_the_metric(
    tmp_path: Path, case: str, named: str
) -> None:
    path = str(tmp_path / "metrics.jsonl")
    for rank, outcome in enumerate(run_ranks(_mismatched_rank, 2, path, case, timeout_s=150)):
        error = outcome["error"]
        assert error is not None, f"rank {rank} built a Telemetry over mismatched metrics"
        assert error["type"] == LayoutMismatchError.__name__
        assert "ranks hold different metric sets" in error["message"]
        assert named in error["message"], error["message"]
        assert error["elapsed_s"] < NOT_A_HANG_S
        assert outcome["threads"] == [] and outcome["children"] == []
    assert not Path(path).exists() or _exported_steps(path) == [], "nothing was exported"


# -- a rank killed mid-run --------------------------------------------------------------------


def _killed_rank(rank: int, world_size: int) -> dict[str, Any]:
    path = os.environ["TORCHTELEMETRY_TEST_JSONL"]
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(
        metrics, [tt.JsonlExporter(path)], every=EVERY, timeout_s=TIMEOUT_S, signals=False
    )
    first = _train(telemetry, metrics, range(4))
    assert first is None, first
    if rank == 1:
        telemetry.flush()  # its windows up to step 3 complete on both ranks before it dies
        os.kill(os.getpid(), signal.SIGKILL)  # an OOM-killed or crashed rank: no cleanup, no goodbye
    error = _train(telemetry, metrics, range(4, 200))
    with pytest.raises(RuntimeError, match="stopped after a failed collection"):
        telemetry.step(10_001)  # the peers are gone: no further collection is attempted
    return {"error": error, **_close(telemetry)}


@pytest.mark.timeout(180)
def test_a_killed_rank_gives_the_survivor_a_clear_error_and_close_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "metrics.jsonl")
    monkeypatch.setenv("TORCHTELEMETRY_TEST_JSONL", path)  # spawned ranks inherit the environment
    survivor = run_ranks(_killed_rank, 2, victim=1, timeout_s=150)[0]
    error = survivor["error"]
    assert error is not None, "rank 0 trained on although rank 1 was killed"
    assert error["type"] == "CollectionError"
    assert "collector's process group (ranks [0, 1]) failed: a rank may have died" in error["message"]
    assert error["elapsed_s"] < NOT_A_HANG_S
    assert survivor["close_s"] < NOT_A_HANG_S
    assert survivor["close_error"] is None, "close() after a failed collection only releases resources"
    assert survivor["threads"] == [] and survivor["children"] == []
    assert _exported_steps(path)[:2] == [1, 3]


def _state_dict_after_the_store_host_died(rank: int, world_size: int) -> dict[str, Any] | None:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, [], every=EVERY, timeout_s=TIMEOUT_S, signals=False)
    assert _train(telemetry, metrics, range(2)) is None
    dist.barrier()
    if rank == 0:  # the rank that hosts the TCPStore dies, and the store with it
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)  # rank 1 calls it once rank 0 is gone (or, on a loaded host, while it dies)
    started = time.monotonic()
    try:
        telemetry.state_dict()
    except Exception as error:
        return _error(error, started)
    return None


@pytest.mark.timeout(180)
def test_state_dict_after_the_store_host_died_raises_the_clear_error_not_the_store_s() -> None:
    outcome = run_ranks(_state_dict_after_the_store_host_died, 2, victim=0, rendezvous="tcp", timeout_s=150)[
        1
    ]
    assert outcome is not None and outcome["type"] == "RuntimeError", outcome
    assert outcome["message"].startswith("Telemetry.state_dict (rank 1 of 2): not every rank called it"), (
        outcome
    )
    assert outcome["elapsed_s"] < NOT_A_HANG_S


# -- the user's own exception inside `with Telemetry(...)` ----------------------------------------------


def _raising_rank(rank: int, world_size: int) -> dict[str, Any]:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    try:
        with tt.Telemetry(metrics, [], every=EVERY, timeout_s=TIMEOUT_S, signals=False) as telemetry:
            for step in range(6 if rank == 0 else 5):
                metrics["loss"].update(torch.tensor(float(step)))
                telemetry.step(step)
                if step == 5:  # rank 0 only: a bad batch, a failed assertion, an OOM of the user's code
                    raise ValueError("the user's own error at step 5")
    except ValueError as error:
        return {"type": "ValueError", "message": str(error), "notes": getattr(error, "__notes__", [])}
    except CollectionError as error:
        return {"type": "CollectionError", "message": str(error)}
    return {"type": None}


@pytest.mark.timeout(180)
def test_the_user_s_own_exception_inside_with_telemetry_is_not_replaced_by_close_s() -> None:
    raised, stopped = run_ranks(_raising_rank, 2, timeout_s=150)
    # Rank 0 left the block with a partial window ending at step 5, rank 1 with one ending at 4:
    # close() cannot collect it on either rank. Rank 0's ValueError still reaches its except.
    assert raised["type"] == "ValueError", raised
    assert raised["message"] == "the user's own error at step 5"
    assert any(note.startswith("Telemetry.close() failed too: CollectionError") for note in raised["notes"])
    assert stopped["type"] == "CollectionError", "a rank without an error of its own gets close()'s"


# -- a collective call made on one rank only ---------------------------------------------------------


def _state_dict_on_rank_zero_only(rank: int, world_size: int) -> dict[str, Any]:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, [], every=EVERY, timeout_s=TIMEOUT_S, signals=False)
    assert _train(telemetry, metrics, range(3)) is None
    outcome: dict[str, Any] = {"error": None}
    if rank == 0:  # e.g. `if rank == 0: torch.save(telemetry.state_dict(), path)`
        started = time.monotonic()
        try:
            telemetry.state_dict()
        except Exception as error:
            outcome["error"] = _error(error, started)
    dist.barrier()  # rank 1 trains on meanwhile; both come back here
    started = time.monotonic()
    try:  # the check's gloo group is spent after a timeout: every rank is told so at once
        telemetry.state_dict()
        outcome["again"] = None
    except RuntimeError as error:
        outcome["again"] = _error(error, started)
    # Both ranks come to close() together (neither waited out timeout_s above), so the last window
    # completes within timeout_s; close's own timeout_s bounds the exporters' flush on a loaded host.
    return {**outcome, **_close(telemetry, timeout_s=NOT_A_HANG_S)}


@pytest.mark.timeout(180)
def test_state_dict_on_one_rank_only_raises_naming_it_within_timeout_s() -> None:
    alone, other = run_ranks(_state_dict_on_rank_zero_only, 2, timeout_s=150, pg_timeout_s=120)
    error = alone["error"]
    assert error is not None and error["type"] == "RuntimeError", error
    assert error["message"].startswith("Telemetry.state_dict (rank 0 of 2): not every rank called it")
    assert "call it on every rank" in error["message"]
    assert error["elapsed_s"] < NOT_A_HANG_S
    assert other["error"] is None
    for outcome in (alone, other):
        again = outcome["again"]
        assert again is not None and again["message"].startswith("Telemetry.state_dict (rank"), again
        assert "an earlier call did not reach every rank" in again["message"]
        assert "it timed out on rank 0" in again["message"], again  # told by the store, not waited out
        assert again["elapsed_s"] < NOT_A_HANG_S
    for outcome in (alone, other):
        assert outcome["close_error"] is None and outcome["threads"] == [] and outcome["children"] == []
