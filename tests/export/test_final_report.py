"""The final report reaches a real Prometheus on both routes: the scrape endpoint lingers until it is
scraped, at the scrape cadence it has seen (past close's timeout from a background thread), and never
waits for nothing; the Pushgateway keeps it and marks the run finished."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from tests.distributed import free_port
from tests.servers import PrometheusServer, PushgatewayServer, http_get
from torchtelemetry import PrometheusExporter, PushgatewayExporter, SumMetric, Telemetry
from torchtelemetry.export import UNKNOWN_INTERVAL_S, MetricDescriptor, RunInfo, final_scrape_due
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
    exporter = PrometheusExporter(port=0)
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


def _scraped_twice(exporter: PrometheusExporter, gap_s: float) -> float:
    """Two scrapes `gap_s` apart: the endpoint has a scraper with that cadence. Returns an upper bound
    of the gap the endpoint saw (a loaded machine stretches it)."""
    start = time.monotonic()
    http_get(exporter.url)
    time.sleep(gap_s)
    http_get(exporter.url)
    deadline = time.monotonic() + 10.0  # the endpoint notes a delivery after sending it, maybe after the read
    while len(exporter._collector.delivered_at()) < 2:
        assert time.monotonic() < deadline, "the endpoint never noted the second scrape"
        time.sleep(0.01)
    return time.monotonic() - start


def test_close_says_it_waits_and_returns_once_a_scrape_read_the_final_report(caplog) -> None:
    exporter = PrometheusExporter(port=0)
    exporter.describe([MetricDescriptor("tokens", MetricKind.COUNTER)], RunInfo(run_id="waits"))
    exporter.export(1, {"tokens": 10.0}, 1.0)
    gap_s = _scraped_twice(exporter, 20.0)  # a scraper every ~20 s: the next is due within 1.5 gaps + 1 s
    exporter.export(2, {"tokens": 20.0}, 2.0)  # the final report, not scraped yet
    url = exporter.url
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        closing = threading.Thread(target=exporter.close, args=(120.0,))
        closing.start()
        deadline = time.monotonic() + 30
        while "for a scrape of the final report" not in caplog.text:
            assert time.monotonic() < deadline, "close() did not say that it waits"
            time.sleep(0.05)
        assert closing.is_alive(), "close() waits for the scrape"
        body = http_get(url).decode()
        closing.join(30)
    assert not closing.is_alive(), "close() returned once the final report was scraped"
    assert 'torchtelemetry_train_step{route="scrape",run="waits"} 2.0' in body
    assert 'torchtelemetry_tokens_total{route="scrape",run="waits"} 20.0' in body
    assert 'torchtelemetry_run_finished_timestamp_seconds{route="scrape",run="waits"}' in body
    assert re.search(
        rf"waiting up to (\d+) s for a scrape of the final report at {re.escape(url)}", caplog.text
    )
    # The wait follows the cadence seen, not the 60 s assumed without one.
    waited = int(re.search(r"waiting up to (\d+) s", caplog.text).group(1))
    assert waited <= math.ceil(1.5 * gap_s + 1) < UNKNOWN_INTERVAL_S


@pytest.mark.slow
def test_the_final_report_reaches_a_prometheus_scraping_less_often_than_close_may_wait(
    prometheus: PrometheusServer,
) -> None:
    """Prometheus scrapes every 8 s, close() may take 4: the endpoint serves the final report past
    close() from a background thread until Prometheus has scraped it (it used to stop after its
    linger_s, cut to close's timeout, and Prometheus never got the end of the run)."""
    prometheus.scrape_interval_s = 8.0
    run_id = f"slow-scrape-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    prometheus.scrape("trainer", [f"127.0.0.1:{exporter.port}"])
    prometheus.start()
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    step = f'torchtelemetry_train_step{{run="{run_id}"}}'
    prometheus.wait_for(f"count_over_time({step}[5m]) >= 2", timeout_s=60)  # the cadence is known
    (last,) = prometheus.query(f"timestamp({step})")
    prometheus.wait_for(f"timestamp({step}) > {last.value}", timeout_s=30)  # a scrape just happened
    _train(telemetry, tokens, range(4, STEPS))
    telemetry.close(timeout_s=4.0)  # returns long before the next scrape, 8 s after the last
    assert _reaches(prometheus, "torchtelemetry_train_step", run_id, lambda value: value == STEPS - 1)
    assert _reaches(
        prometheus, "torchtelemetry_tokens_total", run_id, lambda total: total == STEPS * TOKENS_PER_STEP
    )
    assert _reaches(prometheus, "torchtelemetry_run_finished_timestamp_seconds", run_id, lambda at: at > 0)


def test_a_new_exporter_on_the_port_ends_the_background_linger(caplog) -> None:
    """A run that closed while its final report waited for a scrape must not keep the next run of the
    same process off the port."""
    port = free_port()
    first = PrometheusExporter(port=port)
    first.describe([MetricDescriptor("tokens", MetricKind.COUNTER)], RunInfo(run_id="first"))
    first.export(1, {"tokens": 1.0}, 1.0)
    _scraped_twice(first, 10.0)  # the next scrape is due within 16 s
    first.export(2, {"tokens": 2.0}, 2.0)
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        first.close(3.0)
        assert "keeps serving it until the next scrape" in caplog.text
        assert b'run="first"' in http_get(f"http://127.0.0.1:{port}/metrics"), "served past close()"
        second = PrometheusExporter(port=port)
        second.describe([MetricDescriptor("tokens", MetricKind.COUNTER)], RunInfo(run_id="second"))
    second.export(1, {"tokens": 5.0}, 1.0)
    body = http_get(second.url).decode()
    assert 'run="second"' in body and 'run="first"' not in body
    second.close(5.0)


def test_final_scrape_due_follows_the_cadence_and_gives_up_on_a_stopped_scraper() -> None:
    assert final_scrape_due([], now=100.0) is None  # never scraped
    assert final_scrape_due([90.0, 100.0, 110.0], now=111.0) == 110.0 + 15.0 + 1.0  # every 10 s
    assert final_scrape_due([90.0, 100.0, 110.0], now=126.5) is None  # it missed its scrape: gone
    assert final_scrape_due([0.0, 60.0, 61.0, 120.0], now=121.0) == 120.0 + 1.5 * 59.0 + 1.0  # the median gap
    assert (
        final_scrape_due([100.0], now=101.0) == 100.0 + UNKNOWN_INTERVAL_S + 1.0
    )  # one scrape: Prometheus' default


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
    # The closed run's health, as the gateway keeps it: every report exported, none one short.
    exported = telemetry.hub.health()["pushgateway"].exported_reports
    assert exported == 5  # windows ending at 1, 3, 5, 7 and the partial one at 8
    assert (
        f'torchtelemetry_exporter_exported_reports_total{{exporter="pushgateway",instance="",job="torchtelemetry",'
        f'route="pushgateway",run="{run_id}"}} {exported}' in body
    )


def test_keep_on_close_false_deletes_the_group(pushgateway: PushgatewayServer) -> None:
    run_id = f"deleted-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PushgatewayExporter(pushgateway.url, keep_on_close=False)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    _train(telemetry, tokens, range(3))
    telemetry.close()
    assert [group for group in pushgateway.groups() if group.get("run") == run_id] == []


@pytest.mark.parametrize("scraped", ["never", "already", "stopped"])
def test_no_linger_when_nothing_scrapes_or_the_final_report_was_read(scraped: str, caplog) -> None:
    """close() never waits for nothing: not for a scraper that never came, nor for a scrape of what was
    read already, nor for a scraper that stopped (it missed the scrape its cadence made due)."""
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, signals=False)
    _train(telemetry, tokens, range(2))
    telemetry.flush()
    if scraped == "stopped":
        _scraped_twice(exporter, 0.2)  # a scraper every 0.2 s...
        time.sleep(1.5)  # ...that missed its next scrapes (due within 1.3 s): gone
        _train(telemetry, tokens, range(2, 4))
    if scraped == "already":
        assert b"torchtelemetry_tokens_total" in http_get(exporter.url)
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=5)  # a linger would overrun this: close would abandon the exporter
    assert "final report" not in caplog.text
    assert "abandoning" not in caplog.text
