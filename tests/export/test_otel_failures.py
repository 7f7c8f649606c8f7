"""OTelExporter when the receiver fails: outages, partial successes, a closed exporter, a clock set back."""

from __future__ import annotations

import json
import logging
import time

import pytest

import torchtelemetry as tt
from tests.export.otlp import LOSS, otel_exporter, report_value
from tests.receivers import metrics_by_name
from torchtelemetry.export import ExportHub, ExportResult, MetricDescriptor, OTelExporter, RunInfo
from torchtelemetry.metric import MetricKind

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")


# -- outages ----------------------------------------------------------------------------


def test_receiver_down_then_up(target):
    exporter = otel_exporter(target)
    exporter.describe([LOSS], RunInfo(run_id="outage"))
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.SUCCESS

    target.receiver.stop()
    for step in (2, 3, 4):
        assert exporter.export(step, {"train/loss": float(step)}, time.time()) is ExportResult.FAILURE
    assert not exporter.force_flush(1)  # the newest report is still undelivered

    target.receiver.start()
    step, deadline = 5, time.monotonic() + 60
    while exporter.export(step, {"train/loss": float(step)}, time.time()) is not ExportResult.SUCCESS:
        assert time.monotonic() < deadline, "exports never recovered after the receiver came back"
        step += 1
    for later in (step + 1, step + 2):
        assert exporter.export(later, {"train/loss": float(later)}, time.time()) is ExportResult.SUCCESS
    assert exporter.force_flush(5)
    exporter.close(5)
    assert target.steps() == [1, step, step + 1, step + 2]


def test_failed_report_is_delivered_by_flush(target):
    exporter = otel_exporter(target)
    exporter.describe([LOSS], RunInfo(run_id="flush-retry"))
    target.receiver.stop()
    assert exporter.export(3, {"train/loss": 3.0}, time.time()) is ExportResult.FAILURE
    target.receiver.start()
    deadline = time.monotonic() + 60
    while not exporter.force_flush(5):  # a gRPC channel in reconnect backoff may need another attempt
        assert time.monotonic() < deadline, "the kept report was never delivered"
    exporter.close(5)
    assert target.steps() == [3]


def test_outage_through_the_hub(target):
    hub = ExportHub([otel_exporter(target)], run=RunInfo(run_id="hub-outage"), queue_size=4)
    try:
        hub.describe([LOSS])
        hub.submit(1, {"train/loss": 1.0})
        assert hub.force_flush(30)
        target.receiver.stop()
        for step in range(2, 6):
            hub.submit(step, {"train/loss": float(step)})  # returns at once: the exporter thread waits
        assert not hub.force_flush(30)
        health = hub.health()["otlp"]
        assert health.errors >= 1
        assert health.errors + health.dropped_reports == 4
        assert target.steps() == [1]

        target.receiver.start()
        step, deadline = 6, time.monotonic() + 60
        while True:
            hub.submit(step, {"train/loss": float(step)})
            if hub.force_flush(30) and step in target.steps():
                break
            assert time.monotonic() < deadline, "reports never arrived after the receiver came back"
            step += 1
        errors = hub.health()["otlp"].errors
        for later in (step + 1, step + 2):
            hub.submit(later, {"train/loss": float(later)})
        assert hub.force_flush(30)
        assert target.steps()[-2:] == [step + 1, step + 2]
        assert hub.health()["otlp"].errors == errors
        assert report_value(target.receiver.received[-1].request, "train.loss") == float(step + 2)
    finally:
        hub.close(10)


def test_close_twice_warns_and_export_after_close_fails(http_receiver, caplog):
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint)
    exporter.describe([LOSS], RunInfo(run_id="twice"))
    exporter.close()
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.FAILURE
    assert http_receiver.received == []


def test_a_partial_success_is_an_error_logged_once_with_the_count_and_message(target, caplog):
    caplog.set_level(logging.INFO, logger="torchtelemetry")
    exporter = otel_exporter(target)
    exporter.describe([LOSS, MetricDescriptor("seen", MetricKind.COUNTER)], RunInfo(run_id="partial"))
    target.receiver.partial_success = (1, "seen: unsupported temporality")
    for step in (1, 2):
        assert exporter.export(step, {"train/loss": 1.0, "seen": 2.0}, time.time()) is ExportResult.FAILURE
    assert not exporter.force_flush(5), "the newest report was not delivered whole"
    assert target.steps() == [1, 2], "a partially rejected report is not sent again (OTLP)"
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1, failures
    assert "rejected 1 of 3 data points" in failures[0] and "seen: unsupported temporality" in failures[0]

    target.receiver.partial_success = None
    assert exporter.export(3, {"train/loss": 1.0, "seen": 3.0}, time.time()) is ExportResult.SUCCESS
    assert exporter.force_flush(5)
    exporter.close(5)
    assert "recovered after 2 failures" in caplog.text


def test_a_wall_clock_set_back_mid_run_moves_no_start_time_and_no_timestamp_back(
    http_receiver, monkeypatch, tmp_path
):
    real_time, real_time_ns = time.time, time.time_ns
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint, timeout_s=5)
    jsonl = tmp_path / "metrics.jsonl"
    with tt.Telemetry(
        {"seen": tt.SumMetric(kind="counter")}, [exporter, tt.JsonlExporter(jsonl)], every=1, signals=False
    ) as telemetry:
        for step in range(6):
            if step == 3:  # NTP steps the clock an hour back, mid-run
                monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
                monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() - 3600 * 10**9)
            telemetry.metrics["seen"].update(1.0)
            telemetry.step(step)
            telemetry.flush()
    points = [metrics_by_name(r.request)["seen"].sum.data_points[0] for r in http_receiver.received]
    assert [point.as_double for point in points] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert len({point.start_time_unix_nano for point in points}) == 1, "the counter's start never moves"
    times = [point.time_unix_nano for point in points]
    assert times == sorted(times) and points[0].start_time_unix_nano <= times[0]
    stamps = [json.loads(line)["timestamp"] for line in jsonl.read_text().splitlines()]
    assert stamps == sorted(stamps) and len(stamps) == 6
