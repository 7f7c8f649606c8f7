"""The final report reaches a real Prometheus on both routes: the scrape endpoint lingers until it is
scraped, the Pushgateway keeps it and marks the run finished."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from tests.servers import PrometheusServer, PushgatewayServer, http_get
from torchtelemetry import PrometheusExporter, PushgatewayExporter, SumMetric, Telemetry
from torchtelemetry.export import MetricDescriptor, RunInfo
from torchtelemetry.metric import MetricKind

EVERY, STEPS = 2, 9  # windows end at 1, 3, 5, 7; close() exports the partial window ending at 8
TOKENS_PER_STEP = 10.0


def _train(telemetry: Telemetry, metric: SumMetric, steps: range) -> None:
    for step in steps:
        metric.update(torch.tensor(TOKENS_PER_STEP))
        telemetry.step(step)


def _reaches(prometheus: PrometheusServer, name: str, run_id: str, expected: Callable[[float], bool]) -> bool:
    """Whether the newest value Prometheus holds of `name` for the run (the series may be stale by
    now) comes to satisfy `expected` within 30 s: the last scrape or push of a run is only queryable
    once Prometheus has ingested it, a moment after close() returns."""
    try:
        prometheus.wait_for(
            f'last_over_time({name}{{run="{run_id}"}}[5m])',
            predicate=lambda samples: len(samples) == 1 and expected(samples[0].value),
            timeout_s=30,
        )
    except TimeoutError:
        return False
    return True


def test_close_keeps_serving_until_the_final_report_is_scraped(prometheus: PrometheusServer) -> None:
    run_id = f"linger-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0, linger_s=20)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    prometheus.scrape("trainer", [f"127.0.0.1:{exporter.port}"])
    prometheus.start()
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()  # the collection of step 3 is exported, not left in flight
    prometheus.wait_for(f'torchtelemetry_train_step{{run="{run_id}"}} >= 3', timeout_s=60)
    _train(telemetry, tokens, range(4, STEPS))
    telemetry.close()
    assert exporter.url is None, "the endpoint is closed once the final report was scraped"
    assert _reaches(prometheus, "torchtelemetry_train_step", run_id, lambda step: step == STEPS - 1)
    assert _reaches(
        prometheus, "torchtelemetry_tokens_total", run_id, lambda total: total == STEPS * TOKENS_PER_STEP
    )
    assert _reaches(prometheus, "torchtelemetry_run_finished_timestamp_seconds", run_id, lambda at: at > 0)


def test_close_says_it_waits_and_returns_once_a_scrape_read_the_final_report(caplog) -> None:
    exporter = PrometheusExporter(port=0, linger_s=60)
    exporter.describe([MetricDescriptor("tokens", MetricKind.COUNTER)], RunInfo(run_id="waits"))
    exporter.export(1, {"tokens": 10.0}, 1.0)
    assert b"torchtelemetry_tokens_total" in http_get(exporter.url)  # something scrapes this endpoint
    exporter.export(2, {"tokens": 20.0}, 2.0)  # the final report, not scraped yet
    url = exporter.url
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        closing = threading.Thread(target=exporter.close, args=(120.0,))
        closing.start()
        deadline = time.monotonic() + 30
        while "(linger_s) for a scrape of the final report" not in caplog.text:
            assert time.monotonic() < deadline, "close() did not say that it waits"
            time.sleep(0.05)
        assert closing.is_alive(), "close() waits for the scrape"
        body = http_get(url).decode()
        closing.join(30)
    assert not closing.is_alive(), "close() returned once the final report was scraped"
    assert 'torchtelemetry_train_step{route="scrape",run="waits"} 2.0' in body
    assert 'torchtelemetry_tokens_total{route="scrape",run="waits"} 20.0' in body
    assert 'torchtelemetry_run_finished_timestamp_seconds{route="scrape",run="waits"}' in body
    assert f"waiting up to 60 s (linger_s) for a scrape of the final report at {url}" in caplog.text


def test_the_pushgateway_keeps_the_final_report_marked_finished(
    prometheus: PrometheusServer, pushgateway: PushgatewayServer
) -> None:
    run_id = f"finished-{uuid.uuid4().hex[:8]}"
    prometheus.scrape("pushgateway", [pushgateway.address], honor_labels=True)
    prometheus.start()
    tokens = SumMetric(kind="counter")
    exporter = PushgatewayExporter(pushgateway.url)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    _train(telemetry, tokens, range(STEPS))
    telemetry.close()

    assert {"job": "torchtelemetry", "run": run_id} in pushgateway.groups()
    body = http_get(f"{pushgateway.url}/metrics").decode()
    assert (
        f'torchtelemetry_run_finished_timestamp_seconds{{instance="",job="torchtelemetry",route="pushgateway",run="{run_id}"}}'
        in body
    )
    assert _reaches(prometheus, "torchtelemetry_train_step", run_id, lambda step: step == STEPS - 1)
    assert _reaches(
        prometheus, "torchtelemetry_tokens_total", run_id, lambda total: total == STEPS * TOKENS_PER_STEP
    )
    assert _reaches(prometheus, "torchtelemetry_run_finished_timestamp_seconds", run_id, lambda at: at > 0)


def test_keep_on_close_false_deletes_the_group(pushgateway: PushgatewayServer) -> None:
    run_id = f"deleted-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PushgatewayExporter(pushgateway.url, keep_on_close=False)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    _train(telemetry, tokens, range(3))
    telemetry.close()
    assert [group for group in pushgateway.groups() if group.get("run") == run_id] == []


@pytest.mark.parametrize("scraped", [False, True], ids=["never-scraped", "scraped-already"])
def test_no_linger_when_nothing_scrapes_or_the_final_report_was_read(scraped: bool, caplog) -> None:
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0, linger_s=600)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, signals=False)
    _train(telemetry, tokens, range(2))
    telemetry.flush()
    if scraped:
        assert b"torchtelemetry_tokens_total" in http_get(exporter.url)
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=5)  # a linger would overrun this: close would abandon the exporter
    assert "linger_s" not in caplog.text
    assert "abandoning" not in caplog.text
