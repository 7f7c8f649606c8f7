"""The OTLP endpoint rule and temporality preference, against a real OTLP/HTTP receiver."""

from __future__ import annotations

import logging
import os
import time

import pytest

from tests.receivers import OtlpHttpReceiver, metrics_by_name
from torchtelemetry.export import ExportHub, ExportResult, MetricDescriptor, OTelExporter, RunInfo
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
