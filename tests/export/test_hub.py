"""ExportHub: fan-out on one thread per exporter, bounded queues, isolation of failing exporters, health."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.servers import http_get
from torchtelemetry import JsonlExporter, PrometheusExporter
from torchtelemetry.export import (
    ExporterStartError,
    ExportHub,
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    ReportValues,
    RunInfo,
)
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import InvalidMetricNameError, NameCollisionError

RUN = RunInfo(run_id="hub-run")
LOSS = MetricDescriptor("train/loss", description="Training loss")


class RecordingExporter:
    """An in-memory exporter: keeps what it is given, on which thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.described: list[tuple[MetricDescriptor, ...]] = []
        self.reports: list[tuple[int, dict[str, Any]]] = []
        self.threads: set[str] = set()
        self.flushes = 0
        self.closes = 0

    def describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self.described.append(tuple(descriptors))

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        self.threads.add(threading.current_thread().name)
        self.reports.append((step, dict(values)))
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        self.flushes += 1
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        self.closes += 1


class FlakyExporter(RecordingExporter):
    """Raises while `failing` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.failing = True

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        if self.failing:
            raise ConnectionError(f"backend down at step {step}")
        return super().export(step, values, timestamp)


class StuckExporter(RecordingExporter):
    """Blocks inside export until released, like a backend that never answers."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        self.entered.set()
        self.release.wait()
        return super().export(step, values, timestamp)


@pytest.fixture
def stuck() -> Iterator[StuckExporter]:
    exporter = StuckExporter("stuck")
    yield exporter
    exporter.release.set()  # let its abandoned thread finish


def test_fan_out_health_and_close(tmp_path: Path) -> None:
    jsonl = JsonlExporter(tmp_path / "reports.jsonl")
    recorder = RecordingExporter("recorder")
    hub = ExportHub([jsonl, recorder], run=RUN)
    hub.describe([LOSS])
    for step in range(1, 6):
        hub.submit(step, {"train/loss": 1.0 / step}, timestamp=1000.0 + step)
    assert hub.force_flush(30)
    health = hub.health()
    assert set(health) == {"jsonl", "recorder"}
    assert all((h.exported_reports, h.errors, h.dropped_reports) == (5, 0, 0) for h in health.values())
    assert all(h.last_success_timestamp is not None for h in health.values())
    assert recorder.threads == {"torchtelemetry-export-recorder"}
    assert [step for step, _ in recorder.reports] == [1, 2, 3, 4, 5]
    # The hub's health travels with every report, as counters labelled by exporter.
    step, last = recorder.reports[-1]
    # A report counts itself where it arrives: the last one says all 5 arrived (not 4 forever).
    assert last["exporter/exported_reports"]["recorder"] == 5.0
    assert last["exporter/errors"] == {"jsonl": 0.0, "recorder": 0.0}
    described = {d.name: d for d in recorder.described[0]}
    assert described["exporter/exported_reports"].kind is MetricKind.COUNTER
    assert described["exporter/exported_reports"].label_name == "exporter"
    assert described["exporter/last_success_timestamp"].unit == "seconds"
    hub.close(30)
    assert (recorder.flushes, recorder.closes) == (2, 1)
    lines = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert lines[0]["timestamp"] == 1001.0 and lines[0]["run_id"] == "hub-run"
    with pytest.warns(RuntimeWarning, match="already closed"):
        hub.close(1)
    hub.submit(6, {"train/loss": 0.1})  # ignored after close, never raises
    assert recorder.reports[-1][0] == 5


def test_failing_and_stuck_exporters_are_isolated(
    tmp_path: Path, stuck: StuckExporter, caplog: pytest.LogCaptureFixture
) -> None:
    flaky, recorder = FlakyExporter("flaky"), RecordingExporter("recorder")
    jsonl = JsonlExporter(tmp_path / "reports.jsonl")
    hub = ExportHub([flaky, stuck, recorder, jsonl], run=RUN, queue_size=4)
    hub.describe([LOSS])

    def healthy_exporters_done(step: int) -> bool:
        health = hub.health()
        return health["flaky"].errors == step and all(
            health[name].exported_reports == step for name in ("recorder", "jsonl")
        )

    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        hub.submit(1, {"train/loss": 1.0})
        assert stuck.entered.wait(30)  # step 1 is stuck inside export
        for step in range(2, 22):
            hub.submit(step, {"train/loss": float(step)})  # never waits for the stuck exporter
            wait_until(lambda step=step: healthy_exporters_done(step))
        assert not hub.force_flush(2)  # the stuck exporter cannot flush
        health = hub.health()
        # The stuck exporter holds step 1 and a queue of 4 (steps 18..21): the 16 oldest were dropped.
        assert (health["stuck"].dropped_reports, health["stuck"].exported_reports) == (16, 0)
        assert all(health[name].dropped_reports == 0 for name in ("flaky", "recorder", "jsonl"))
        hub.close(2)  # returns although one exporter never finishes
    lines = [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 22))  # the other exporters kept exporting
    assert lines[-1]["values"]["exporter/dropped_reports"]["stuck"] == 16.0
    assert lines[-1]["values"]["exporter/errors"]["flaky"] in (20.0, 21.0)  # as of jsonl's export of step 21
    assert (flaky.closes, recorder.closes, stuck.closes) == (1, 1, 0)
    messages = [record.getMessage() for record in caplog.records]
    assert len([m for m in messages if "'flaky'" in m and "backend down" in m]) == 1  # once per burst
    queue_full = [m for m in messages if "queue full" in m]
    assert len(queue_full) == 1 and "'stuck'" in queue_full[0]
    assert any("'stuck'" in m and "abandoning" in m for m in messages)


def test_a_full_queue_drops_logged_values_before_a_window(stuck: StuckExporter) -> None:
    """A framework that logs every step (accelerate) while the exporter is held up: the full queue
    drops the logs, oldest first, and keeps the windows' reports; with only windows queued, the
    oldest goes, never the newest report."""
    hub = ExportHub([stuck], run=RUN, queue_size=4)
    hub.describe([LOSS])
    hub.submit(1, {"log/lr": 0.1})
    assert stuck.entered.wait(30)  # step 1 is in flight
    for step in range(2, 21):
        if step % 5 == 0:  # a window every 5 steps, with the value logged at its step riding in it
            hub.submit(step, {"log/lr": 0.1, "train/loss": float(step)}, window={"train/loss": float(step)})
        else:
            hub.submit(step, {"log/lr": 0.1})
    hub.submit(21, {"log/lr": 0.1})  # the queue holds windows 5, 10, 15 and 20 only: 5 goes
    stuck.release.set()
    assert hub.force_flush(30)
    hub.close(30)
    assert [step for step, _ in stuck.reports] == [1, 10, 15, 20, 21]
    assert [values.get("train/loss") for _, values in stuck.reports] == [None, 10.0, 15.0, 20.0, None]
    health = hub.health()["stuck"]
    assert (health.exported_reports, health.dropped_reports) == (5, 16)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_errors_are_logged_once_per_burst(caplog: pytest.LogCaptureFixture) -> None:
    flaky = FlakyExporter("flaky")
    hub = ExportHub([flaky], run=RUN)
    hub.describe([LOSS])
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        for step, failing in enumerate([True, True, True, False, True, True, False], start=1):
            flaky.failing = failing
            hub.submit(step, {"train/loss": float(step)})
            assert hub.force_flush(30)
        hub.close(30)
    messages = [r.getMessage() for r in caplog.records if "'flaky'" in r.getMessage()]
    assert [m for m in messages if "backend down" in m] == [
        "exporter 'flaky': export of step 1 raised: ConnectionError: backend down at step 1; "
        "further failures are counted, not logged, until one succeeds",
        "exporter 'flaky': export of step 5 raised: ConnectionError: backend down at step 5; "
        "further failures are counted, not logged, until one succeeds",
    ]
    assert [m for m in messages if "recovered" in m] == [
        "exporter 'flaky': recovered after 3 failures",
        "exporter 'flaky': recovered after 2 failures",
    ]
    assert hub.health()["flaky"].errors == 5


class MisbehavingExporter(RecordingExporter):
    """While `misbehaving`, export raises `misbehaviour` (an exception) or returns it; close raises it."""

    def __init__(self, name: str, misbehaviour: object) -> None:
        super().__init__(name)
        self.misbehaviour = misbehaviour
        self.misbehaving = True

    def export(self, step: int, values: ReportValues, timestamp: float) -> ExportResult:
        if not self.misbehaving:
            return super().export(step, values, timestamp)
        if isinstance(self.misbehaviour, BaseException):
            raise self.misbehaviour
        return self.misbehaviour  # type: ignore[return-value]

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        if self.misbehaving and isinstance(self.misbehaviour, BaseException):
            raise self.misbehaviour
        return super().force_flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        super().close(timeout_s)
        if isinstance(self.misbehaviour, BaseException):
            raise self.misbehaviour


@pytest.mark.parametrize(
    ("misbehaviour", "reason"),
    [
        (SystemExit(3), "raised: SystemExit: 3"),
        (KeyboardInterrupt("typed ^C"), "raised: KeyboardInterrupt: typed ^C"),
        (True, "returned True, not an ExportResult"),
        (None, "returned None, not an ExportResult"),
    ],
    ids=["SystemExit", "KeyboardInterrupt", "True", "None"],
)
def test_an_exporter_thread_survives_whatever_its_exporter_raises_or_returns(
    misbehaviour: object, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = MisbehavingExporter("odd", misbehaviour)
    hub = ExportHub([exporter], run=RUN, queue_size=4)
    hub.describe([LOSS])
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        for step in range(1, 21):
            hub.submit(step, {"train/loss": float(step)})
        hub.force_flush(30)  # returns once everything before it was exported, failed or dropped
        health = hub.health()["odd"]
        assert health.exported_reports + health.errors + health.dropped_reports == 20
        assert health.errors >= 1
        exporter.misbehaving = False
        hub.submit(21, {"train/loss": 21.0})
        assert hub.force_flush(30)  # the thread is alive and exports again
        hub.close(30)
    health = hub.health()["odd"]
    assert health.exported_reports == 1 and [step for step, _ in exporter.reports] == [21]
    assert health.exported_reports + health.errors + health.dropped_reports == 21
    assert exporter.closes == 1
    assert not [t for t in threading.enumerate() if t.name == "torchtelemetry-export-odd"]
    messages = [r.getMessage() for r in caplog.records if "'odd'" in r.getMessage()]
    assert len([m for m in messages if reason in m and "export of step" in m]) == 1  # once, with the reason
    assert f"exporter 'odd': recovered after {health.errors} failures" in messages


def test_collisions_and_illegal_names_raise_at_describe_before_any_thread() -> None:
    threads_before = set(threading.enumerate())
    prometheus, recorder = PrometheusExporter(port=0), RecordingExporter("recorder")
    hub = ExportHub([recorder, prometheus], run=RUN)
    with pytest.raises(NameCollisionError, match=r"\['train/loss', 'train.loss'\]"):
        hub.describe([LOSS, MetricDescriptor("train.loss")])
    with pytest.raises(NameCollisionError, match="exporter/exported_reports"):
        taken = MetricDescriptor("exporter/exported_reports", MetricKind.COUNTER)  # the hub's health
        hub.describe([taken])
    with pytest.raises(InvalidMetricNameError, match="bad name"):
        hub.describe([MetricDescriptor("train/bad name")])
    assert set(threading.enumerate()) <= threads_before
    assert prometheus.url is None
    with pytest.raises(RuntimeError, match=r"describe\(descriptors\) first"):
        hub.submit(1, {"train/loss": 1.0})
    hub.close(5)
    assert recorder.closes == 1


def test_new_names_are_described_on_the_exporter_threads(caplog: pytest.LogCaptureFixture) -> None:
    prometheus, recorder = PrometheusExporter(port=0), RecordingExporter("recorder")
    hub = ExportHub([prometheus, recorder], run=RUN)
    hub.describe([LOSS])
    histogram = HistogramValue(bounds=(1.0,), counts=(2.0, 1.0), sum=3.5, count=3.0)
    report = {"train/loss": 0.5, "extra/lr": 0.01, "extra/grad": histogram, "extra/bad name": 1.0}
    with caplog.at_level(logging.ERROR, logger="torchtelemetry"):
        hub.submit(1, report)
        hub.submit(2, report)
        assert hub.force_flush(30)
    kinds = {d.name: d.kind for d in recorder.described[-1]}
    assert kinds["extra/lr"] is MetricKind.GAUGE and kinds["extra/grad"] is MetricKind.HISTOGRAM
    assert "extra/bad name" not in kinds and "extra/bad name" not in recorder.reports[-1][1]
    assert len([r for r in caplog.records if "bad name" in r.getMessage()]) == 1
    body = http_get(prometheus.url).decode()
    assert 'torchtelemetry_extra_lr{route="scrape",run="hub-run"} 0.01' in body
    assert 'torchtelemetry_extra_grad_bucket{le="+Inf",route="scrape",run="hub-run"} 3.0' in body
    assert hub.health()["prometheus"].errors == 0
    hub.close(30)


def test_an_exporter_that_cannot_start_stops_the_set_up_naming_why() -> None:
    threads_before = set(threading.enumerate())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        hub = ExportHub([PrometheusExporter(port=port), RecordingExporter("recorder")], run=RUN)
        with pytest.raises(ExporterStartError, match=f"port {port}"):
            hub.describe([LOSS])  # the port is taken: the run must not train on without its endpoint
        hub.close(30)
    assert set(threading.enumerate()) <= threads_before, "no exporter thread was started"


def test_bad_configuration_raises() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        ExportHub([], run=RUN, queue_size=0)
    with pytest.raises(ValueError, match=r"\['twin'\].*distinct name="):
        ExportHub([RecordingExporter("twin"), RecordingExporter("twin")], run=RUN)
