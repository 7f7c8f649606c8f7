"""OTelExporter against real OTLP/HTTP and OTLP/gRPC receivers decoding the wire protocol."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import pytest

from tests.distributed import free_port, run_ranks
from tests.export.otlp import LOSS, report_step, report_value
from tests.export.workload import STEPS, expected_values, global_report, make_metrics, update_window
from tests.receivers import (
    attributes,
    metrics_by_name,
    resource_attributes,
)
from torchtelemetry.export import (
    OTEL_SCHEMA_URL,
    ExportHub,
    ExportResult,
    HistogramValue,
    MetricDescriptor,
    NullHub,
    OTelExporter,
    RunInfo,
)
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import Exemplar, NameCollisionError, describe_metrics

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

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
    assert report_step(request) == step
    assert report_value(request, "train.loss") == expected["train/loss"]

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
    assert report_value(request.request, "train.loss") == 0.5


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
    assert report_step(request.request) == 7


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
    # process.pid and service.instance.id are incubating: the spec's strings, not semconv's private module
    expected = {SERVICE_NAME, "service.instance.id", "process.pid", "deployment.environment.name"}
    assert expected <= set(resource)
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


def test_a_histograms_exemplar_reaches_the_wire_with_its_trace_and_span(http_receiver):
    exemplar = Exemplar(value=0.3, timestamp=1_700_000_000.25, trace_id="0a" * 16, span_id="0b" * 8)
    descriptor = MetricDescriptor("train/step_time/histogram", MetricKind.HISTOGRAM, "seconds")
    exporter = OTelExporter(endpoint=http_receiver.metrics_endpoint)
    exporter.describe([descriptor], RunInfo(run_id="exemplar"))
    value = HistogramValue((0.1, 1.0), (1.0, 2.0, 0.0), 0.5, 3.0, exemplar)
    assert exporter.export(4, {descriptor.name: value}, 1_700_000_000.5) is ExportResult.SUCCESS
    exporter.close()
    metric = metrics_by_name(http_receiver.received[0].request)["train.step_time.histogram"]
    (point,) = metric.histogram.data_points
    (sent,) = point.exemplars
    assert (sent.trace_id.hex(), sent.span_id.hex()) == ("0a" * 16, "0b" * 8)
    assert (sent.as_double, sent.time_unix_nano) == (0.3, round(1_700_000_000.25 * 1e9))
