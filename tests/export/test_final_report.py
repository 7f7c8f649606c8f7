"""The final report reaches a real Prometheus on both routes: the scrape endpoint lingers until the
run's scraper (a steady cadence whose next scrape is due within linger_s) has read it whole (close()
waits past its timeout for it, at most linger_s, and leaves no thread behind), and never waits for a
client that is no such scraper (a filtered GET, one or two manual reads, a probe every 15 minutes);
the Pushgateway keeps it and marks the run finished.

No assertion here compares with the clock: what is asserted is what each scraper read, with clients
that scrape on their own cadence (`Scraper`) and real Prometheus servers.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable

import pytest
import torch

from tests.servers import PrometheusServer, PushgatewayServer, http_get
from torchtelemetry import PrometheusExporter, PushgatewayExporter, SumMetric, Telemetry
from torchtelemetry.export import DEFAULT_LINGER_S, UNKNOWN_INTERVAL_S, final_scrape_due

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


class Scraper:
    """A client that scrapes `url` on its own cadence, as Prometheus does, with its own User-Agent
    (and `query`, e.g. a `name[]` filter), keeping every body it read; reads of a closed endpoint fail
    and are skipped."""

    def __init__(self, url: str, every_s: float, agent: str = "test-scraper/1.0", query: str = "") -> None:
        self.url, self.every_s, self.agent, self.query = url, every_s, agent, query
        self.bodies: list[str] = []
        self._read = threading.Condition()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"scraper-{agent}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            request = urllib.request.Request(self.url + self.query, headers={"User-Agent": self.agent})
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    body = response.read().decode()
            except OSError:
                body = None
            if body is not None:
                with self._read:
                    self.bodies.append(body)
                    self._read.notify_all()
            if self._stopped.wait(self.every_s):
                return

    def stop(self) -> list[str]:
        """Stop scraping, once a read under way has ended; every body read."""
        self._stopped.set()
        self._thread.join(30)
        assert not self._thread.is_alive()
        return self.bodies


def _known_as_scraper(
    exporter: PrometheusExporter, agent: str, reads: int = 3, timeout_s: float = 60.0
) -> None:
    """Wait until the endpoint has noted `reads` whole reads (three: a cadence) by a client whose
    User-Agent starts with `agent`."""
    deadline = time.monotonic() + timeout_s
    while not any(
        client.startswith(agent) and len(seen) >= reads
        for (_, client), seen in exporter.final_scrape.log.reads().items()
    ):
        assert time.monotonic() < deadline, f"the endpoint never saw {agent} scrape {reads} times"
        time.sleep(0.01)


@pytest.fixture
def non_daemon_threads() -> Callable[[], list[str]]:
    """The non-daemon threads started since the test began (what would keep the process alive; an
    earlier test's executor in the same process is not the run's)."""
    before = set(threading.enumerate())

    def started() -> list[str]:
        return [t.name for t in set(threading.enumerate()) - before if not t.daemon]

    return started


def _closed_while_scraped_every_3_s(
    caplog, timeout_s: float, **options: float
) -> tuple[Telemetry, list[str]]:
    """A run "waits" scraped every 3 s (a known cadence), closed with `timeout_s`, its exporter
    built with `options`; what the scraper read."""
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0, **options)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id="waits", signals=False)
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    scraper = Scraper(exporter.url, every_s=3.0)
    _known_as_scraper(exporter, scraper.agent)
    _train(telemetry, tokens, range(4, STEPS))
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=timeout_s)
    return telemetry, scraper.stop()


def test_close_waits_past_its_timeout_until_the_scraper_read_the_final_report(
    caplog, non_daemon_threads
) -> None:
    """A scraper slower than close's timeout (Prometheus' default minute against close()'s default
    30 s, here 3 s against 0.5 s): close() waits for its next scrape, through the hub, and that scrape
    read the final report; no thread is left to keep the process alive."""
    telemetry, bodies = _closed_while_scraped_every_3_s(caplog, timeout_s=0.5)
    final = bodies[-1]
    assert f'torchtelemetry_train_step{{route="scrape",run="waits"}} {float(STEPS - 1)}' in final
    assert f'torchtelemetry_tokens_total{{route="scrape",run="waits"}} {STEPS * TOKENS_PER_STEP}' in final
    assert 'torchtelemetry_run_finished_timestamp_seconds{route="scrape",run="waits"}' in final
    assert re.search(
        r"waiting up to \d+ s for 127\.0\.0\.1 \(test-scraper/1\.0\) to read the final report", caplog.text
    )
    assert "abandoning" not in caplog.text
    assert telemetry.hub.health()["prometheus"].errors == 0
    assert non_daemon_threads() == []


def test_only_the_scraper_that_scraped_the_run_ends_the_wait(
    prometheus: PrometheusServer, caplog, non_daemon_threads
) -> None:
    """A liveness probe every 0.05 s, plain and `name[]`-filtered, beside a Prometheus scraping every
    2 s: close() (timeout 0.5 s) still waits until Prometheus has read the final report (a probe's
    read of it used to end the wait, and Prometheus' last read was an earlier step)."""
    prometheus.scrape_interval_s = 2.0
    run_id = f"probed-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    prometheus.scrape("trainer", [f"127.0.0.1:{exporter.port}"])
    prometheus.start()
    probes = [
        Scraper(exporter.url, every_s=0.05, agent="kube-probe/1.30"),
        Scraper(
            exporter.url, every_s=0.05, agent="filtered-probe/1.0", query="?name[]=torchtelemetry_train_step"
        ),
    ]
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    step = f'torchtelemetry_train_step{{run="{run_id}"}}'
    prometheus.wait_for(f"count_over_time({step}[5m]) >= 2", timeout_s=60)  # Prometheus keeps a cadence
    _known_as_scraper(exporter, "Prometheus/")
    _known_as_scraper(exporter, "kube-probe/1.30")
    _train(telemetry, tokens, range(4, STEPS))
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=0.5)
    for probe in probes:
        probe.stop()
    assert _reaches(prometheus, "torchtelemetry_train_step", run_id, lambda value: value == STEPS - 1)
    assert _reaches(
        prometheus, "torchtelemetry_tokens_total", run_id, lambda total: total == STEPS * TOKENS_PER_STEP
    )
    assert _reaches(prometheus, "torchtelemetry_run_finished_timestamp_seconds", run_id, lambda at: at > 0)
    scrapers = {agent for _, agent in exporter.final_scrape.log.reads()}
    assert "kube-probe/1.30" in scrapers and "filtered-probe/1.0" not in scrapers, (
        "a filtered GET is no scraper"
    )
    assert non_daemon_threads() == []


def test_a_single_manual_read_is_no_scraper_and_keeps_nothing_alive(caplog, non_daemon_threads) -> None:
    """One `curl` a few steps before the end used to hold a finished process a minute past close()
    (Prometheus' default interval assumed, on a non-daemon thread)."""
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, signals=False)
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    assert b"torchtelemetry_tokens_total" in http_get(exporter.url)
    _train(telemetry, tokens, range(4, STEPS))
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=5)
    assert "final report" not in caplog.text
    assert exporter.url is None
    assert non_daemon_threads() == []


@pytest.mark.slow
@pytest.mark.parametrize("interval_s", [8.0, 60.0])
def test_the_final_report_reaches_a_prometheus_scraping_less_often_than_close_may_wait(
    prometheus: PrometheusServer, interval_s: float
) -> None:
    """Prometheus scrapes every 8 s, or at its default minute, close() may take 4: right after a
    scrape, close() waits past its timeout, within the default linger_s, until Prometheus has scraped
    the final report (it used to stop after its linger_s, cut to close's timeout, and Prometheus
    never got the end of the run)."""
    prometheus.scrape_interval_s = interval_s
    run_id = f"slow-scrape-{uuid.uuid4().hex[:8]}"
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, run_id=run_id, signals=False)
    prometheus.scrape("trainer", [f"127.0.0.1:{exporter.port}"])
    prometheus.start()
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    _known_as_scraper(exporter, "Prometheus/", reads=1, timeout_s=2 * interval_s)  # a scrape just happened
    _train(telemetry, tokens, range(4, STEPS))
    telemetry.close(timeout_s=4.0)  # shorter than the time to the next scrape: close() waits for it
    assert _reaches(prometheus, "torchtelemetry_train_step", run_id, lambda value: value == STEPS - 1)
    assert _reaches(
        prometheus, "torchtelemetry_tokens_total", run_id, lambda total: total == STEPS * TOKENS_PER_STEP
    )
    assert _reaches(prometheus, "torchtelemetry_run_finished_timestamp_seconds", run_id, lambda at: at > 0)


def test_only_a_steady_scraper_whose_next_scrape_is_due_within_linger_s_holds_close() -> None:
    """The verdicts on synthetic read times (seconds): the run's scraper is due an interval, a tenth
    of it and a second after its last read; any other client is waited for not at all."""
    assert DEFAULT_LINGER_S == 75.0
    every_minute = [0.0, 60.0, 120.0]  # Prometheus at its default interval
    assert final_scrape_due(every_minute, now=121.0) == pytest.approx(120.0 + 66.0 + 1.0)
    assert final_scrape_due([100.0], now=101.0, prometheus=True) == pytest.approx(
        100.0 + 1.1 * UNKNOWN_INTERVAL_S + 1.0
    )  # one read by a Prometheus: its default minute assumed
    assert final_scrape_due([0.0, 10.0, 20.4], now=21.0) == pytest.approx(20.4 + 1.1 * 10.4 + 1.0)  # jitter
    assert final_scrape_due([], now=100.0) is None  # never read
    assert final_scrape_due([100.0], now=101.0) is None  # one manual read
    assert final_scrape_due([0.0, 10.0], now=11.0) is None  # two manual reads 10 s apart: no cadence
    assert final_scrape_due([0.0, 10.0, 35.0], now=36.0) is None  # no steady interval
    assert final_scrape_due([0.0, 900.0, 1800.0], now=1801.0) is None  # a probe every 15 minutes
    assert final_scrape_due([0.0, 900.0, 1800.0], now=1801.0, linger_s=1000.0) == pytest.approx(2791.0)
    assert final_scrape_due([90.0, 100.0, 110.0], now=122.5) is None  # it missed its scrape: gone
    assert final_scrape_due([90.0, 100.0, 110.0], now=111.0, linger_s=0.0) is None


def test_a_client_that_read_twice_does_not_hold_close(caplog, non_daemon_threads) -> None:
    """Two manual reads (10 s apart in the report, 0.5 s here) made the endpoint wait for a third at
    that cadence: close(timeout_s=2) took 16.6 s, and a health check every 15 minutes held a finished
    job about 23 minutes."""
    tokens = SumMetric(kind="counter")
    exporter = PrometheusExporter(port=0)
    telemetry = Telemetry({"tokens": tokens}, [exporter], every=EVERY, signals=False)
    _train(telemetry, tokens, range(0, 4))
    telemetry.flush()
    for _ in range(2):
        assert b"torchtelemetry_tokens_total" in http_get(exporter.url)
        time.sleep(0.5)
    _train(telemetry, tokens, range(4, STEPS))
    assert exporter.closing_until() is None
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=2)
    assert "final report" not in caplog.text
    assert exporter.url is None
    assert non_daemon_threads() == []


def test_a_scraper_slower_than_linger_s_does_not_hold_close(caplog) -> None:
    """A steady scraper every 3 s against linger_s=2: its next scrape cannot come within the bound
    close() promises, so close() does not wait for it at all (close's timeout is no limit here)."""
    _closed_while_scraped_every_3_s(caplog, timeout_s=10.0, linger_s=2.0)
    assert "final report" not in caplog.text


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
    assert pushgateway.groups_once_deleted(run_id) == []


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
        scraper = Scraper(exporter.url, every_s=0.2)  # a scraper every 0.2 s...
        _known_as_scraper(exporter, scraper.agent)
        scraper.stop()  # ...that misses its next scrape: once it was due, the scraper is gone
        deadline = time.monotonic() + 60
        while any(
            final_scrape_due(reads, time.monotonic()) for reads in exporter.final_scrape.log.reads().values()
        ):
            assert time.monotonic() < deadline, "the scrape never came due"
            time.sleep(0.05)
        _train(telemetry, tokens, range(2, 4))
    if scraped == "already":
        assert b"torchtelemetry_tokens_total" in http_get(exporter.url)
    with caplog.at_level(logging.INFO, logger="torchtelemetry"):
        telemetry.close(timeout_s=5)  # a linger would overrun this: close would abandon the exporter
    assert "final report" not in caplog.text
    assert "abandoning" not in caplog.text
