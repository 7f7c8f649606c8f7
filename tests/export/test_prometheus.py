"""PrometheusExporter against a real Prometheus server, fed by a real 2-rank gloo run, and its exposition."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import urllib.error
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.distributed import free_port, run_ranks
from tests.export.scraped_run import (
    DESCRIPTORS,
    RUN,
    WORLD_SIZE,
    check_observations,
    prometheus_quantile,
    sample_report,
    train_and_export,
)
from tests.servers import PrometheusServer, Sample, http_get, self_signed_cert
from torchtelemetry import (
    PrometheusExporter,
)
from torchtelemetry.export import ExportHub, ExportResult, HistogramValue, MetricDescriptor, NullHub, RunInfo
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import Exemplar, NameCollisionError


@pytest.mark.slow
def test_gloo_run_scraped_by_prometheus(prometheus: PrometheusServer) -> None:
    port, run_id = free_port(), f"gloo-{uuid.uuid4().hex[:8]}"
    prometheus.scrape("trainer", [f"127.0.0.1:{port}"])
    prometheus.start()
    rank0, rank1 = run_ranks(
        train_and_export, WORLD_SIZE, "prometheus", str(port), prometheus.url, f'run="{run_id}"', run_id,
        timeout_s=240,
    )  # fmt: skip
    check_observations(rank0)
    assert rank1 == {"threads": [], "served": None}  # rank 1 opened no port, started no thread


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exporter = PrometheusExporter(port=0)
    yield exporter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tests may have closed it already
        exporter.close()


def families(body: bytes) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(body.decode())}


def test_exposition_kinds_labels_and_histograms(exporter: PrometheusExporter) -> None:
    exporter.describe(DESCRIPTORS, RUN)
    assert exporter.port not in (0, None)
    assert exporter.export(7, sample_report(7), 1700000000.5) is ExportResult.SUCCESS
    found = families(http_get(exporter.url))
    assert found["torchtelemetry_train_step"].samples[0].value == 7
    assert found["torchtelemetry_last_update_timestamp_seconds"].samples[0].value == 1700000000.5
    assert found["torchtelemetry_train_loss"].type == "gauge"
    assert found["torchtelemetry_train_loss"].documentation == "Training loss"
    tokens = found["torchtelemetry_train_tokens"]
    assert tokens.type == "counter" and [(s.name, s.value) for s in tokens.samples] == [
        ("torchtelemetry_train_tokens_total", 7000.0)
    ]
    step_time = found["torchtelemetry_train_step_time_seconds"]
    assert {s.labels["rank"]: s.value for s in step_time.samples} == {"0": 0.25, "1": 0.5}
    histogram = found["torchtelemetry_grad_norm"]
    assert histogram.type == "histogram"
    by_name = {(s.name, s.labels.get("le")): s.value for s in histogram.samples}
    assert by_name == {
        ("torchtelemetry_grad_norm_bucket", "0.5"): 1.0,
        ("torchtelemetry_grad_norm_bucket", "1.0"): 3.0,
        ("torchtelemetry_grad_norm_bucket", "2.0"): 6.0,
        ("torchtelemetry_grad_norm_bucket", "+Inf"): 10.0,
        ("torchtelemetry_grad_norm_count", None): 10.0,
        ("torchtelemetry_grad_norm_sum", None): 17.5,
    }
    for family in found.values():
        for sample in family.samples:
            assert sample.labels["run"] == "run-1"
            assert "step" not in sample.labels


def test_promtool_check_metrics_is_clean(exporter: PrometheusExporter, promtool: str) -> None:
    hub = ExportHub([exporter], run=RUN)
    hub.describe(DESCRIPTORS)
    hub.submit(1, sample_report(1))
    hub.submit(2, sample_report(2))
    assert hub.force_flush(10)
    body = http_get(exporter.url)
    assert b"torchtelemetry_exporter_exported_reports_total" in body
    assert b"torchtelemetry_exporter_last_success_timestamp_seconds" in body
    checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, b"")
    hub.close(10)
    with pytest.raises(urllib.error.URLError):
        http_get(f"http://127.0.0.1:{exporter.port}/metrics", timeout_s=2)  # close() shut the server


def test_one_scrape_shows_one_step(exporter: PrometheusExporter) -> None:
    exporter.describe(DESCRIPTORS, RUN)
    stop = threading.Event()

    def keep_exporting() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            report = {
                "train/loss": float(step),
                "train/tokens": float(step),
                "train/step_time": {"0": float(step)},
            }
            exporter.export(step, report, float(step))

    writer = threading.Thread(target=keep_exporting)
    writer.start()
    try:
        steps_seen = set()
        for _ in range(200):
            found = families(http_get(exporter.url))
            if "torchtelemetry_train_step" not in found:
                continue
            values = {s.value for family in found.values() for s in family.samples}
            assert len(values) == 1, values  # step, timestamp and every value come from one report
            steps_seen |= values
    finally:
        stop.set()
        writer.join()
    assert len(steps_seen) > 1


def test_port_zero_scraped_over_tls(tmp_path: Path, prometheus: PrometheusServer) -> None:
    certfile, keyfile = self_signed_cert(tmp_path / "tls")
    exporter = PrometheusExporter(port=0, certfile=str(certfile), keyfile=str(keyfile))
    try:
        exporter.start()
        assert exporter.url == f"https://127.0.0.1:{exporter.port}/metrics"
        exporter.describe(DESCRIPTORS, RUN)
        exporter.export(5, sample_report(5), 1700000000.0)
        prometheus.scrape(
            "tls", [f"127.0.0.1:{exporter.port}"], scheme="https", tls_config={"ca_file": str(certfile)}
        )
        prometheus.start()
        samples = prometheus.wait_for('torchtelemetry_train_tokens_total{job="tls",run="run-1"}')
        assert samples == [Sample(samples[0].labels, 5000.0)]
        (median,) = prometheus.wait_for('histogram_quantile(0.5, torchtelemetry_grad_norm_bucket{job="tls"})')
        assert median.value == prometheus_quantile(0.5, [0.5, 1.0, 2.0], [1, 2, 3, 4])
        with pytest.raises(OSError):
            http_get(f"http://127.0.0.1:{exporter.port}/metrics", timeout_s=5)  # plain HTTP is refused
    finally:
        exporter.close()


def test_port_none_registers_in_the_callers_registry() -> None:
    registry = CollectorRegistry()
    exporter = PrometheusExporter(port=None, registry=registry)
    exporter.describe(DESCRIPTORS, RUN)
    exporter.export(3, sample_report(3), 1.0)
    assert b'torchtelemetry_train_loss{route="scrape",run="run-1"} 1.5' in generate_latest(registry)
    exporter.close()
    assert b"torchtelemetry" not in generate_latest(registry)


def test_constructor_opens_nothing_and_null_hub_opens_no_port() -> None:
    port = free_port()
    threads_before = set(threading.enumerate())
    exporter = PrometheusExporter(port=port)
    hub = NullHub()
    hub.describe(DESCRIPTORS)
    hub.submit(1, sample_report(1))
    assert hub.force_flush(1) and hub.health() == {}
    hub.close(1)
    assert exporter.url is None
    assert set(threading.enumerate()) == threads_before
    with pytest.raises(urllib.error.URLError):
        http_get(f"http://127.0.0.1:{port}/metrics", timeout_s=2)
    exporter.close()


@pytest.mark.parametrize(
    ("descriptors", "message"),
    [
        ([MetricDescriptor("train/loss"), MetricDescriptor("train.loss")], "torchtelemetry_train_loss"),
        ([MetricDescriptor("train/step")], "torchtelemetry_train_step"),
        ([MetricDescriptor("loss", label_name="run")], "label 'run'"),
        (
            [MetricDescriptor("grad", MetricKind.HISTOGRAM), MetricDescriptor("grad/count")],
            "torchtelemetry_grad_count",
        ),
        ([MetricDescriptor("tokens", MetricKind.COUNTER), MetricDescriptor("tokens/total")], "tokens_total"),
    ],
)
def test_collisions_raise_at_describe(descriptors: list[MetricDescriptor], message: str) -> None:
    exporter = PrometheusExporter(port=0)
    with pytest.raises(NameCollisionError, match=message):
        exporter.describe(descriptors, RUN)
    assert exporter.url is None  # nothing started
    exporter.close()


def test_export_problems_and_close_are_reported_not_raised(exporter: PrometheusExporter) -> None:
    exporter.describe(DESCRIPTORS, RUN)
    assert exporter.export(1, {"not/described": 1.0}, 1.0) is ExportResult.FAILURE
    assert exporter.export(1, {"train/loss": HistogramValue((1.0,), (1.0, 1.0), 1.0, 2.0)}, 1.0) is (
        ExportResult.FAILURE
    )
    exporter.close()
    assert exporter.export(2, sample_report(2), 2.0) is ExportResult.FAILURE
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="port"):
        PrometheusExporter(port=70000)
    with pytest.raises(ValueError, match="certfile and keyfile"):
        PrometheusExporter(port=0, certfile="cert.pem")
    with pytest.raises(ValueError, match="registry"):
        PrometheusExporter(port=None)


def test_a_series_keeps_its_last_value_when_a_report_does_not_carry_it() -> None:
    registry = CollectorRegistry()
    exporter = PrometheusExporter(port=None, registry=registry)
    exporter.describe([MetricDescriptor("train/loss"), MetricDescriptor("eval/loss")], RunInfo(run_id="r"))
    exporter.export(10, {"train/loss": 1.5}, 100.0)
    exporter.export(10, {"eval/loss": 2.5}, 101.0)  # a framework's own log at the same step
    text = generate_latest(registry).decode()
    assert 'torchtelemetry_train_loss{route="scrape",run="r"} 1.5' in text
    assert 'torchtelemetry_eval_loss{route="scrape",run="r"} 2.5' in text
    assert 'torchtelemetry_last_update_timestamp_seconds{route="scrape",run="r"} 101.0' in text
    exporter.close()


@pytest.mark.parametrize(
    ("accept", "openmetrics"),
    [
        ("application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", True),
        ("application/openmetrics-text", True),
        ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5", True),
        ("text/plain;version=0.0.4", False),
        ("*/*", False),
    ],
    ids=["prometheus-2.30", "bare", "prometheus-2.42", "text", "any"],
)
def test_the_endpoint_answers_an_openmetrics_accept_in_openmetrics(accept: str, openmetrics: bool) -> None:
    """Any `application/openmetrics-text` entry gets OpenMetrics (the draft version 0.0.1 that
    Prometheus before 2.31 asks for got the classic text format)."""
    import urllib.request

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    exporter = PrometheusExporter(port=0)
    exporter.describe([MetricDescriptor("tokens", MetricKind.COUNTER)], RunInfo(run_id="om"))
    exporter.export(3, {"tokens": 12.0}, 1.0)
    try:
        request = urllib.request.Request(exporter.url, headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as response:
            content_type, body = response.headers["Content-Type"], response.read().decode()
    finally:
        exporter.close(5)
    assert content_type.startswith("application/openmetrics-text") is openmetrics, content_type
    assert body.endswith("# EOF\n") is openmetrics
    parse = openmetrics_families if openmetrics else text_string_to_metric_families
    samples = {sample.name: sample.value for family in parse(body) for sample in family.samples}
    assert samples["torchtelemetry_tokens_total"] == 12.0


def test_an_exemplar_rides_its_bucket_in_openmetrics_only(exporter: PrometheusExporter) -> None:
    """The step-time histogram's exemplar (the trace of the slowest rank's slowest step): on the bucket
    its value falls in, as OpenMetrics writes it for a scraper that asks for it; the classic text
    format has no place for it and leaves it out."""
    import urllib.request

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    exemplar = Exemplar(value=1.2, timestamp=1700000000.25, trace_id="0a" * 16, span_id="0b" * 8)
    report = sample_report(3)
    report["grad_norm"] = dataclasses.replace(report["grad_norm"], exemplar=exemplar)
    exporter.describe(DESCRIPTORS, RUN)
    assert exporter.export(3, report, 1700000000.5) is ExportResult.SUCCESS
    request = urllib.request.Request(exporter.url, headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        body = response.read().decode()
    (family,) = [f for f in openmetrics_families(body) if f.name == "torchtelemetry_grad_norm"]
    marked = [
        (s.labels["le"], s.exemplar.labels, s.exemplar.value, float(s.exemplar.timestamp))
        for s in family.samples
        if s.exemplar is not None
    ]
    assert marked == [
        ("2.0", {"trace_id": "0a" * 16, "span_id": "0b" * 8}, 1.2, 1700000000.25)
    ]  # 1 < 1.2 <= 2
    classic = http_get(exporter.url).decode()
    assert "trace_id" not in classic and families(classic.encode())["torchtelemetry_grad_norm"]
