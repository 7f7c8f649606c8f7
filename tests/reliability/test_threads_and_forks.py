"""The threading rule (a metric is updated on the thread that built it) and the fork rule (a
Telemetry, collector or exporter hub is used only in the process that built it), each enforced by
a clear error instead of lost updates or a stalled collection. docs/reliability.md "Limits"."""

from __future__ import annotations

import copy
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.metric.examples import METRIC_CLASSES, build, feed
from tests.metric.test_metrics import assert_same_state, states
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.export import ExportHub, ExportResult, RunInfo


def _on_thread(fn: Any) -> BaseException | None:
    """Run `fn` on a new thread; the exception it raised, if any."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=target, name="updater")
    thread.start()
    thread.join(30)
    return raised[0] if raised else None


@pytest.mark.parametrize("cls", METRIC_CLASSES, ids=lambda cls: cls.__name__)
def test_an_update_from_another_thread_raises_and_changes_nothing(cls: type[tt.Metric]) -> None:
    example = cls.examples()[0]
    metric = feed(build(cls, example), example)
    before = states(metric)
    error = _on_thread(lambda: feed(metric, example))
    assert isinstance(error, RuntimeError)
    assert "called from thread 'updater'" in str(error)
    assert "MainThread" in str(error) and "updated on one thread" in str(error)
    assert_same_state(before, metric)


def test_a_metric_built_on_a_thread_is_updated_there() -> None:
    def build_and_update() -> None:
        metric = tt.SumMetric()
        for _ in range(3):
            metric.update(1.0)
        assert metric.compute().item() == 3.0

    assert _on_thread(build_and_update) is None


def test_a_metric_copied_or_unpickled_on_a_thread_belongs_to_that_thread() -> None:
    metric = tt.WeightedMeanMetric()
    metric.update(1.0)

    def copy_and_update() -> None:
        for copied in (pickle.loads(pickle.dumps(metric)), copy.deepcopy(metric)):
            copied.update(3.0)
            assert copied.compute().item() == 2.0

    assert _on_thread(copy_and_update) is None
    assert isinstance(_on_thread(lambda: metric.update(1.0)), RuntimeError)


def test_an_updater_thread_racing_step_is_refused_not_lost(tmp_path: Path) -> None:
    """The issue's race: a thread updating while the training thread calls step(). Every update
    either lands in a window or raises; none is silently lost."""
    metrics = {"seen": tt.SumMetric(kind="counter")}
    path = tmp_path / "metrics.jsonl"
    telemetry = tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=2, signals=False)
    stop = threading.Event()
    refused: list[BaseException] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                metrics["seen"].update(1.0)
            except RuntimeError as error:
                refused.append(error)
                return

    updater = threading.Thread(target=hammer, name="updater")
    updater.start()
    for step in range(100):
        metrics["seen"].update(1.0)
        telemetry.step(step)
    stop.set()
    updater.join(30)
    telemetry.close()
    assert refused and "updated on one thread" in str(refused[0])
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["values"]["seen"] == 100.0


def test_step_schedule_and_flush_from_another_thread_raise() -> None:
    metrics = {"seen": tt.SumMetric(kind="counter")}
    telemetry = tt.Telemetry(metrics, every=1, signals=False)
    metrics["seen"].update(1.0)
    for call in (lambda: telemetry.step(0), telemetry.schedule_collection, telemetry.flush):
        error = _on_thread(call)
        assert isinstance(error, RuntimeError)
        assert "called from thread 'updater', not from the thread that built this Telemetry" in str(error)
    telemetry.step(0)
    telemetry.close()
    assert telemetry.latest["seen"] == 1.0


# -- forks -------------------------------------------------------------------------------------


def _in_fork(call: Any) -> str:
    """Run `call` in a forked child (as a DataLoader worker or a `fork` subprocess would); what it
    raised, or "no error". The child leaves with `os._exit`, running no clean-up of the parent's."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            call()
            message = "no error"
        except BaseException as error:
            message = f"{type(error).__name__}: {error}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(pid, 0)
    return message


def _fork_rank(rank: int, world_size: int, path: str) -> dict[str, Any]:
    metrics = {"seen": tt.SumMetric(kind="counter")}
    telemetry = tt.Telemetry(metrics, [tt.JsonlExporter(path)], every=2, signals=False, timeout_s=60)
    for step in range(3):
        metrics["seen"].update(1.0)
        telemetry.step(step)
    # A training step in the child: before the fork check it waited for the peers for timeout_s.
    error = _in_fork(lambda: telemetry.step(1000))
    # The parent is undisturbed: its windows go on, exactly.
    for step in range(3, 6):
        metrics["seen"].update(1.0)
        telemetry.step(step)
    dist.barrier()
    telemetry.close()
    return {"error": error, "seen": telemetry.latest["seen"]}


@pytest.mark.timeout(120)
def test_telemetry_used_in_a_forked_child_raises_at_once_naming_the_fork(
    tmp_path: Path,
) -> None:
    results = run_ranks(_fork_rank, 2, str(tmp_path / "metrics.jsonl"), timeout_s=100)
    for result in results:
        assert "Telemetry.step: called in process" in result["error"]
        assert "a fork of process" in result["error"]
        assert result["seen"] == 12.0  # 2 ranks x 6 updates


def test_collector_hub_and_exporter_refuse_a_forked_child(tmp_path: Path) -> None:
    metric = tt.SumMetric()
    collector = AsyncMetricCollector({"m": metric}).bind()
    exporter = tt.JsonlExporter(tmp_path / "direct.jsonl")
    exporter.describe([], RunInfo.create("fork"))
    hub = ExportHub([tt.JsonlExporter(tmp_path / "m.jsonl")], run=RunInfo.create("fork"))
    hub.describe([])
    messages = [
        _in_fork(call)
        for call in (
            collector.schedule_collection,
            lambda: hub.submit(0, {"m": 1.0}),
            hub.close,
            lambda: exporter.export(0, {"m": 1.0}, 0.0),
        )
    ]
    assert [m.split(":")[1].strip() for m in messages] == [
        "AsyncMetricCollector.schedule_collection",
        "ExportHub.submit",
        "ExportHub.close",
        "JsonlExporter.export",
    ]
    assert all("a fork of process" in m for m in messages)
    # The parent is undisturbed.
    metric.update(2.0)
    collector.schedule_collection()
    assert collector.collect_results()["m"] == 2.0
    collector.unbind()
    hub.close()
    assert exporter.export(1, {"m": 2.0}, 0.0) is ExportResult.SUCCESS
    exporter.close()
