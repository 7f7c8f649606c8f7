"""The OTLP endpoint rule and temporality preference, against a real OTLP/HTTP receiver."""

from __future__ import annotations

import logging
import os
import time

import pytest

from tests.receivers import OtlpGrpcReceiver, OtlpHttpReceiver, metrics_by_name
from torchtelemetry.export import (
    ExportHub,
    ExportResult,
    MetricDescriptor,
    OTelExporter,
    RunInfo,
    SpanRecord,
)
from torchtelemetry.metric import MetricKind

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

TOKENS = MetricDescriptor("tokens", MetricKind.COUNTER)
LOSS = MetricDescriptor("train/loss")


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@pytest.fixture
def receiver():
    with OtlpHttpReceiver() as running:
        yield running


@pytest.fixture
def grpc_receiver():
    with OtlpGrpcReceiver() as running:
        yield running


@pytest.mark.parametrize("suffix", ["", "/", "/v1/metrics"], ids=["base", "slash", "with-path"])
def test_the_generic_endpoint_gets_v1_metrics_once(receiver, monkeypatch, suffix: str) -> None:
    # What the demo's --otlp sets; docs/stack.md shows it with /v1/metrics, which is not doubled.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint + suffix)
    exporter = OTelExporter(timeout_s=5)
    assert exporter.url == receiver.metrics_endpoint
    exporter.describe([LOSS], RunInfo(run_id="generic"))
    assert exporter.export(1, {"train/loss": 0.5}, time.time()) is ExportResult.SUCCESS
    exporter.close()
    assert [request.path for request in receiver.received] == ["/v1/metrics"]


def test_the_argument_is_the_metrics_endpoint_used_as_is(receiver) -> None:
    assert OTelExporter(endpoint=receiver.endpoint).url == receiver.endpoint  # the OTel rule: no path added
    assert OTelExporter(endpoint=receiver.metrics_endpoint).url == receiver.metrics_endpoint
    assert OTelExporter(protocol="grpc").url == "http://localhost:4317"
    assert OTelExporter().url == "http://localhost:4318/v1/metrics"


def test_a_failed_push_logs_the_url_without_credentials(caplog) -> None:
    with OtlpHttpReceiver(status=404) as refusing:
        url = f"http://user:secret@127.0.0.1:{refusing.port}/v1/metrics"
        exporter = OTelExporter(endpoint=url, timeout_s=5)
        with caplog.at_level(logging.DEBUG):  # the INFO line naming the endpoint, the ERROR of the push
            exporter.describe([LOSS], RunInfo(run_id="refused"))
            assert exporter.export(1, {"train/loss": 0.5}, time.time()) is ExportResult.FAILURE
            exporter.close(1)
    redacted = f"http://***@127.0.0.1:{refusing.port}/v1/metrics"
    assert exporter.url == redacted
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("torchtelemetry")]
    assert any(f"http/protobuf to {redacted}" in m for m in logged), logged
    assert any(f"push to {redacted} failed" in m for m in logged), logged
    assert "secret" not in caplog.text  # ours, the SDK's, urllib3's, at every level


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize(
    "given",
    [
        {"endpoint": "http://127.0.0.1:4318/v1/metrics?api_key=k3y-in-query"},
        {
            "env": {
                "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:4318/v1/metrics?api_key=k3y-in-query"
            }
        },
        {"env": {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318?api_key=k3y-in-query"}},
        {"endpoint": "http://127.0.0.1:4318/v1/metrics#k3y-in-query"},
    ],
)
def test_an_endpoint_with_a_query_string_is_refused_saying_to_use_headers(
    protocol: str, given: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenTelemetry SDK logs the URL's path and query with every failed push (4 WARNING lines
    with ?api_key=... when the collector was down): a token there cannot be kept out of the logs."""
    for name, value in given.get("env", {}).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="has a query or a fragment") as refused:
        OTelExporter(protocol=protocol, endpoint=given.get("endpoint"))
    assert "OTEL_EXPORTER_OTLP_HEADERS" in str(refused.value)
    assert "k3y-in-query" not in str(refused.value)


def _sums(receiver: OtlpHttpReceiver) -> list[tuple[float, int, int, int]]:
    """(value, temporality, start, time) of the `tokens` counter in each request."""
    out = []
    for request in receiver.received:
        data = metrics_by_name(request.request)["tokens"].sum
        (point,) = data.data_points
        out.append(
            (point.as_double, data.aggregation_temporality, point.start_time_unix_nano, point.time_unix_nano)
        )
    return out


@pytest.mark.parametrize("preference", ["delta", "lowmemory"])
def test_delta_preference_sends_what_was_added_since_the_last_delivery(
    receiver, monkeypatch, preference
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", preference)
    hub = ExportHub(
        [OTelExporter(endpoint=receiver.metrics_endpoint, timeout_s=5)], run=RunInfo(run_id=preference)
    )
    try:
        hub.describe([TOKENS])
        hub.submit(1, {"tokens": 10.0}, 100.0, window={"tokens": 10.0})
        assert hub.force_flush(10)
        receiver.stop()
        hub.submit(2, {"tokens": 30.0}, 200.0, window={"tokens": 20.0})
        assert not hub.force_flush(10), "undelivered: the next report carries its increment"
        receiver.start()
        hub.submit(3, {"tokens": 60.0}, 300.0, window={"tokens": 30.0})
        assert hub.force_flush(10)
    finally:
        hub.close(10)
    delta = 1  # AGGREGATION_TEMPORALITY_DELTA in the OTLP protocol
    (first, third) = _sums(receiver)
    assert first[:2] == (10.0, delta)
    assert third[:2] == (50.0, delta), "the failed report's increment is in the next delivered delta"
    assert third[2] == first[3] == 100 * 10**9, "each delta starts where the delivered one ended"


def test_cumulative_is_the_default_and_an_unknown_preference_warns(receiver, monkeypatch, caplog) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "sometimes")
    with caplog.at_level(logging.WARNING):
        exporter = OTelExporter(endpoint=receiver.metrics_endpoint, timeout_s=5)
    assert "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE='sometimes'" in caplog.text
    exporter.describe([TOKENS], RunInfo(run_id="cumulative"))
    for step, total in ((1, 10.0), (2, 30.0)):
        assert exporter.export(step, {"tokens": total}, 100.0 * step) is ExportResult.SUCCESS
    exporter.close()
    cumulative = 2
    assert [(value, temporality) for value, temporality, _, _ in _sums(receiver)] == [
        (10.0, cumulative),
        (30.0, cumulative),
    ]


# -- the traces endpoint: where a rank's spans go (TelemetryConfig.trace_ranks) ------------------


def _span(name: str = "train.step") -> SpanRecord:
    return SpanRecord(name, trace_id=7, span_id=9, parent_id=None, start_ns=1, end_ns=2, attributes={"a": 1})


def test_spans_go_where_the_metrics_go_with_v1_traces_over_http_and_the_same_url_over_grpc(
    receiver, monkeypatch
) -> None:
    assert (
        OTelExporter(endpoint=receiver.metrics_endpoint).traces_endpoint == f"{receiver.endpoint}/v1/traces"
    )
    assert OTelExporter().traces_endpoint == "http://localhost:4318/v1/traces"
    assert OTelExporter(protocol="grpc", endpoint="http://h:4317").traces_endpoint == "http://h:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    sender = OTelExporter(service_name="spans", resource_attributes={"team": "a"}).span_sender()
    assert sender.send([_span()], RunInfo(run_id="r", world_size=4))
    sender.shutdown()
    ((request,),) = [[received] for received in receiver.received_traces]
    assert request.path == "/v1/traces" and receiver.received == []
    (span,) = receiver.spans()
    assert (span.name, span.trace_id, span.span_id, span.parent_span_id) == (
        "train.step",
        f"{7:032x}",
        f"{9:016x}",
        "",
    )
    assert span.resource["service.name"] == "spans" and span.resource["service.instance.id"] == "r"
    assert span.resource["team"] == "a" and span.resource["torchtelemetry.world_size"] == 4


def test_the_traces_endpoint_wins_and_one_that_cannot_be_known_or_has_a_query_is_refused(
    receiver, monkeypatch
) -> None:
    given = OTelExporter(endpoint="http://h:4318/v1/metrics", traces_endpoint=receiver.endpoint + "/t")
    assert given.traces_endpoint == receiver.endpoint + "/t"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://e:4318/custom")
    assert OTelExporter(endpoint="http://h:4318/v1/metrics").traces_endpoint == "http://e:4318/custom"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    custom = OTelExporter(endpoint="http://h:4318/otlp/metrics")  # a metrics path of its own: fine
    with pytest.raises(ValueError, match=r"no traces endpoint.*traces_endpoint=.*trace_ranks=0"):
        custom.span_sender()
    queried = OTelExporter(endpoint="http://h:4318/v1/metrics", traces_endpoint="http://h/v1/traces?k=s3cret")
    with pytest.raises(ValueError, match="has a query or a fragment") as refused:
        queried.span_sender()
    assert "s3cret" not in str(refused.value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20t0ken%0D%0AX-Evil=1")
    exporter = OTelExporter(endpoint="http://h:4318/v1/metrics")  # metrics alone do not read it
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_TRACES_HEADERS.*'authorization'") as refused:
        exporter.span_sender()
    assert "t0ken" not in str(refused.value)


def test_spans_over_grpc_reach_the_trace_service(grpc_receiver) -> None:
    sender = OTelExporter(
        protocol="grpc", endpoint=grpc_receiver.endpoint, headers={"X-Team": "a"}
    ).span_sender()
    assert sender.send([_span("train.forward")], RunInfo(run_id="g"))
    sender.shutdown()
    ((received,),) = [[r] for r in grpc_receiver.received_traces]
    assert received.headers["x-team"] == "a" and [s.name for s in grpc_receiver.spans()] == ["train.forward"]
