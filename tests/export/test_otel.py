"""OTelExporter against real OTLP/HTTP and OTLP/gRPC receivers decoding the wire protocol."""

from __future__ import annotations

import bisect
import json
import logging
import os
import sys
import time
from typing import Any, NamedTuple

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import free_port, run_ranks
from tests.receivers import (
    OtlpGrpcReceiver,
    OtlpHttpReceiver,
    attributes,
    metrics_by_name,
    resource_attributes,
)
from torchtelemetry.export import (
    OTEL_SCHEMA_URL,
    ExportHub,
    ExportResult,
    MetricDescriptor,
    NullHub,
    OTelExporter,
    RunInfo,
)
from torchtelemetry.metric import MetricKind, metric_leaves, sync_metrics
from torchtelemetry.report import NameCollisionError, describe_metrics, flatten_results, to_python

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

# -- a small deterministic 2-rank workload, shared with test_wandb ----------------------

BINS = [0.5, 1.0, 2.0]
STEPS = [10, 20, 30]


def make_metrics(rank: int, world_size: int) -> dict[str, Any]:
    """The metric tree every rank builds."""
    return {
        "train": {"loss": tt.WeightedMeanMetric()},
        "tokens": tt.SumMetric(kind="counter", unit="tokens"),
        "grad_norm": tt.HistogramMetric(bins=BINS),
        "step_time": tt.PerRankMetric(world_size, rank, unit="seconds"),
    }


def _loss_batch(rank: int, window: int) -> tuple[list[float], list[float]]:
    return [float(rank + window), float(rank + window + 1)], [1.0, 3.0]


def _grad_norms(rank: int, window: int) -> list[float]:
    return [0.25 * (rank + 1), 1.5, 3.0 + rank + window]


def update_window(metrics: dict[str, Any], rank: int, window: int) -> None:
    """Rank-dependent updates of one logging window (state accumulates over windows)."""
    values, weights = _loss_batch(rank, window)
    metrics["train"]["loss"].update(torch.tensor(values), torch.tensor(weights))
    metrics["tokens"].update(100 * (rank + 1))
    metrics["grad_norm"].update(torch.tensor(_grad_norms(rank, window)))
    metrics["step_time"].update(0.25 * (rank + 1))


def global_report(metrics: dict[str, Any]) -> dict[str, Any]:
    """Sync across ranks, then the flattened report every rank computes."""
    sync_metrics(metrics)
    leaves = metric_leaves(metrics)
    return flatten_results(leaves, [to_python(metric.compute()) for _, metric in leaves])


def expected_values(world_size: int, windows: int) -> dict[str, Any]:
    """The exact global values after `windows` windows, computed without torch."""
    weighted = total_weight = 0.0
    norms: list[float] = []
    for window in range(windows):
        for rank in range(world_size):
            values, weights = _loss_batch(rank, window)
            weighted += sum(v * w for v, w in zip(values, weights, strict=True))
            total_weight += sum(weights)
            norms += _grad_norms(rank, window)
    counts = [0] * (len(BINS) + 1)
    for norm in norms:
        counts[bisect.bisect_left(BINS, norm)] += 1  # bucket i holds bins[i-1] < v <= bins[i]
    return {
        "train/loss": weighted / total_weight,
        "tokens": float(windows * sum(100 * (rank + 1) for rank in range(world_size))),
        "grad_norm": {"bounds": BINS, "counts": counts, "sum": sum(norms), "count": len(norms)},
        "step_time": {str(rank): 0.25 * (rank + 1) for rank in range(world_size)},
    }


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture
def http_receiver():
    with OtlpHttpReceiver() as receiver:
        yield receiver


@pytest.fixture
def grpc_receiver():
    with OtlpGrpcReceiver() as receiver:
        yield receiver


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


class Target(NamedTuple):
    """A running receiver, the protocol it speaks and the endpoint an exporter is given."""

    receiver: Any
    protocol: str
    endpoint: str

    def steps(self) -> list[int]:
        return [_step(r.request) for r in self.receiver.received]


@pytest.fixture(params=["http/protobuf", "grpc"])
def target(request):
    if request.param == "grpc":
        with OtlpGrpcReceiver() as receiver:
            yield Target(receiver, "grpc", receiver.endpoint)
    else:
        with OtlpHttpReceiver() as receiver:
            yield Target(receiver, "http/protobuf", receiver.metrics_endpoint)


def _exporter(target: Target, **kwargs: Any) -> OTelExporter:
    return OTelExporter(protocol=target.protocol, endpoint=target.endpoint, timeout_s=1, **kwargs)


LOSS = MetricDescriptor("train/loss")


def _step(request: Any) -> int:
    return metrics_by_name(request)["train.step"].gauge.data_points[0].as_int


def _value(request: Any, name: str) -> float:
    return metrics_by_name(request)[name].gauge.data_points[0].as_double


# -- 2 ranks through the hub ------------------------------------------------------------

RUN_ID = "otel-two-ranks"


def _otel_rank(rank: int, world_size: int) -> int:
    metrics = make_metrics(rank, world_size)
    exporter = OTelExporter(timeout_s=10)  # the same call on every rank, configured by OTEL_* variables
    hub = ExportHub([exporter], run=RunInfo(run_id=RUN_ID, world_size=world_size)) if rank == 0 else NullHub()
    hub.describe(describe_metrics(metrics))
    for window, step in enumerate(STEPS):
        update_window(metrics, rank, window)
        hub.submit(step, global_report(metrics))
    if not hub.force_flush(30):
        raise RuntimeError(f"rank {rank}: force_flush failed: {hub.health()}")
    hub.close(30)
    return os.getpid()


def _assert_report(request: Any, window: int, step: int, world_size: int) -> None:
    expected = expected_values(world_size, window + 1)
    metrics = metrics_by_name(request)
    assert _step(request) == step
    assert _value(request, "train.loss") == expected["train/loss"]

    tokens = metrics["tokens"]
    assert tokens.unit == "{token}"
    assert tokens.sum.is_monotonic
    assert tokens.sum.aggregation_temporality == 2  # CUMULATIVE
    assert tokens.sum.data_points[0].as_double == expected["tokens"]

    histogram = metrics["grad_norm"].histogram
    assert histogram.aggregation_temporality == 2
    (point,) = histogram.data_points
    assert list(point.explicit_bounds) == expected["grad_norm"]["bounds"]
    assert list(point.bucket_counts) == expected["grad_norm"]["counts"]
    assert point.count == expected["grad_norm"]["count"]
    assert point.sum == expected["grad_norm"]["sum"]
    assert not point.HasField("min") and not point.HasField("max")

    step_time = metrics["step_time"]
    assert step_time.unit == "s"
    by_rank = {attributes(p.attributes)["rank"]: p.as_double for p in step_time.gauge.data_points}
    assert by_rank == expected["step_time"]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_two_ranks_export_exact_global_values(protocol, http_receiver, grpc_receiver):
    if protocol == "grpc":
        receiver: Any = grpc_receiver
        env = {  # metrics-specific variables win over the generic ones
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": grpc_receiver.endpoint,
            "OTEL_EXPORTER_OTLP_ENDPOINT": http_receiver.endpoint,
        }
    else:
        receiver = http_receiver
        env = {  # base endpoint: the SDK appends /v1/metrics
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": http_receiver.endpoint,
            "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        }
    env["OTEL_EXPORTER_OTLP_HEADERS"] = "x-team=vision"
    env["OTEL_RESOURCE_ATTRIBUTES"] = "deployment.environment=ci"

    pids = run_ranks(_otel_rank, 2, env=env)

    received = receiver.received
    assert len(received) == len(STEPS)  # one push per report, from rank 0 only
    other = grpc_receiver if receiver is http_receiver else http_receiver
    assert other.received == []
    for window, (request, step) in enumerate(zip(received, STEPS, strict=True)):
        (resource,) = resource_attributes(request.request)
        assert resource["process.pid"] == pids[0] != pids[1]
        assert resource["service.name"] == "torchtelemetry"
        assert resource["service.instance.id"] == RUN_ID
        assert resource["torchtelemetry.world_size"] == 2
        assert resource["deployment.environment"] == "ci"
        assert request.headers["x-team"] == "vision"
        if protocol != "grpc":
            assert request.path == "/v1/metrics"
            assert request.headers["content-encoding"] == "gzip"
        _assert_report(request.request, window, step, world_size=2)
    starts = {
        p.start_time_unix_nano
        for r in received
        for m in metrics_by_name(r.request).values()
        if m.WhichOneof("data") in ("sum", "histogram")
        for p in getattr(m, m.WhichOneof("data")).data_points
    }
    assert len(starts) == 1  # cumulative series keep one start time
    health = metrics_by_name(received[-1].request)["exporter.exported_reports"].sum.data_points
    assert {attributes(p.attributes)["exporter"]: p.as_double for p in health} == {"otlp": 3.0}


# -- configuration ----------------------------------------------------------------------


def test_metrics_endpoint_is_used_as_is(http_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", http_receiver.metrics_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    exporter = OTelExporter(timeout_s=5)
    exporter.describe([LOSS], RunInfo(run_id="endpoint"))
    assert exporter.export(1, {"train/loss": 0.5}, time.time()) is ExportResult.SUCCESS
    exporter.close()
    (request,) = http_receiver.received
    assert request.path == "/v1/metrics"
    assert _value(request.request, "train.loss") == 0.5


def test_arguments_win_over_environment(http_receiver, grpc_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", http_receiver.metrics_endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-source=env")
    exporter = OTelExporter(
        protocol="grpc",
        endpoint=grpc_receiver.endpoint,
        headers={"X-Source": "code"},
        service_name="from-code",
        resource_attributes={"team": "vision"},
        timeout_s=5,
    )
    exporter.describe([LOSS], RunInfo(run_id="args", world_size=4))
    assert exporter.export(7, {"train/loss": 1.25}, time.time()) is ExportResult.SUCCESS
    exporter.close()
    assert http_receiver.received == []
    (request,) = grpc_receiver.received
    assert request.headers["x-source"] == "code"
    (resource,) = resource_attributes(request.request)
    assert resource["service.name"] == "from-code"
    assert resource["team"] == "vision"
    assert resource["torchtelemetry.world_size"] == 4
    assert _step(request.request) == 7


def test_service_name_from_environment(http_receiver, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer-a")
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint, timeout_s=5)
    exporter.describe([LOSS], RunInfo(run_id="env-name"))
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.SUCCESS
    exporter.close()
    (resource,) = resource_attributes(http_receiver.received[0].request)
    assert resource["service.name"] == "trainer-a"
    assert resource["service.instance.id"] == "env-name"


def test_the_resource_carries_the_schema_url_of_its_attribute_names(http_receiver, monkeypatch):
    from opentelemetry.semconv._incubating.attributes.process_attributes import PROCESS_PID
    from opentelemetry.semconv._incubating.attributes.service_attributes import SERVICE_INSTANCE_ID
    from opentelemetry.semconv.attributes.service_attributes import SERVICE_NAME
    from opentelemetry.semconv.schemas import Schemas

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint, timeout_s=5)
    exporter.describe([LOSS], RunInfo(run_id="schema"))
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.SUCCESS
    exporter.close()
    request = http_receiver.received[0].request
    (resource_metrics,) = request.resource_metrics
    assert resource_metrics.schema_url == OTEL_SCHEMA_URL
    assert OTEL_SCHEMA_URL in {schema.value for schema in Schemas}, "a version the conventions define"
    (resource,) = resource_attributes(request)
    assert {SERVICE_NAME, SERVICE_INSTANCE_ID, PROCESS_PID, "deployment.environment.name"} <= set(resource)
    assert all(scope.schema_url == "" for scope in resource_metrics.scope_metrics), "metric names are ours"


def test_bad_protocol(monkeypatch, caplog):
    with pytest.raises(ValueError, match="protocol must be one of"):
        OTelExporter(protocol="http/json")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon")
    with caplog.at_level(logging.WARNING):
        assert OTelExporter().protocol == "http/protobuf"
    assert "carrier-pigeon" in caplog.text


def test_name_collision_is_raised_by_describe():
    exporter = OTelExporter()
    with pytest.raises(NameCollisionError, match=r"train\.loss"):
        exporter.describe([LOSS, MetricDescriptor("train.loss")], RunInfo(run_id="collide"))


def test_sdk_disabled_warns_and_sends_nothing(http_receiver, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint)
    with caplog.at_level(logging.WARNING):
        exporter.describe([LOSS], RunInfo(run_id="disabled"))
    assert "OTEL_SDK_DISABLED=true" in caplog.text
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.SUCCESS
    assert exporter.force_flush()
    exporter.close()
    assert http_receiver.received == []


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.metrics.export", None)
    with pytest.raises(ImportError, match=r"torchtelemetry\[otel\]"):
        OTelExporter()


def test_constructor_opens_nothing(http_receiver):
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint)
    assert exporter.export(1, {"train/loss": 1.0}, time.time()) is ExportResult.FAILURE  # not described
    exporter.close()
    assert http_receiver.received == []


def test_secrets_never_logged(target, caplog):
    secret = "s3cr3t-token-value"
    caplog.set_level(logging.DEBUG)
    # HTTP takes basic-auth credentials in the URL; gRPC refuses them (see test_grpc_endpoint_credentials).
    endpoint = (
        target.endpoint.replace("http://", f"http://user:{secret}@")
        if target.protocol != "grpc"
        else target.endpoint
    )
    exporter = OTelExporter(
        protocol=target.protocol,
        endpoint=endpoint,
        headers={"authorization": f"Bearer {secret}"},
        timeout_s=1,
    )
    exporter.describe([LOSS], RunInfo(run_id="secret"))
    exporter.export(1, {"train/loss": 1.0}, time.time())
    target.receiver.stop()
    assert exporter.export(2, {"train/loss": 1.0}, time.time()) is ExportResult.FAILURE
    exporter.close(timeout_s=1)
    assert "authorization" in caplog.text  # the header is named ...
    assert secret not in caplog.text  # ... its value never is


def test_grpc_endpoint_credentials_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="headers"):
        OTelExporter(protocol="grpc", endpoint="http://user:pw@127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:pw@127.0.0.1:4317")
    with pytest.raises(ValueError, match="headers"):
        OTelExporter(protocol="grpc")


# -- outages ----------------------------------------------------------------------------


def test_receiver_down_then_up(target):
    exporter = _exporter(target)
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
    exporter = _exporter(target)
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
    hub = ExportHub([_exporter(target)], run=RunInfo(run_id="hub-outage"), queue_size=4)
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
        assert _value(target.receiver.received[-1].request, "train.loss") == float(step + 2)
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


def test_counter_and_label_values_of_one_report(http_receiver):
    descriptors = [
        MetricDescriptor("data/samples", MetricKind.COUNTER, "samples", "Samples seen"),
        MetricDescriptor("train/tokens_per_second", unit="tokens_per_second", label_name="rank"),
    ]
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint)
    exporter.describe(descriptors, RunInfo(run_id="kinds"))
    scalars = {"data/samples": 512.0, "train/tokens_per_second": {"0": 10.5, "1": 11.0}}
    assert exporter.export(4, scalars, 1_700_000_000.5) is ExportResult.SUCCESS
    exporter.close()
    metrics = metrics_by_name(http_receiver.received[0].request)
    samples = metrics["data.samples"]
    assert (samples.unit, samples.description) == ("{sample}", "Samples seen")
    assert samples.sum.data_points[0].as_double == 512.0
    assert samples.sum.data_points[0].time_unix_nano == 1_700_000_000_500_000_000
    throughput = metrics["train.tokens_per_second"]
    assert throughput.unit == "{token}/s"
    assert {attributes(p.attributes)["rank"]: p.as_double for p in throughput.gauge.data_points} == {
        "0": 10.5,
        "1": 11.0,
    }


def test_a_partial_success_is_an_error_logged_once_with_the_count_and_message(target, caplog):
    caplog.set_level(logging.INFO, logger="torchtelemetry")
    exporter = _exporter(target)
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
