"""`PrometheusExporter`: rank 0 serves `/metrics`, one consistent step per scrape.

The families come from `PrometheusCollector` (`_exposition.py`), the server from
`ScrapeServer` (`_scrape_server.py`); this module starts, serves and closes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._exposition import PrometheusCollector, import_prometheus_client
from torchtelemetry.export._final_scrape import ScrapeLog, Scraper, end_lingering, lingering
from torchtelemetry.export._naming import NAMESPACE
from torchtelemetry.export._protocol import ExporterStartError, RunInfo
from torchtelemetry.export._scrape_server import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ScrapeServer
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = ["PrometheusExporter"]

logger = logging.getLogger(__name__)

_IN_FLIGHT_S = 2.0
"""Before saying it waits, close() lets a scrape that has read the final report finish sending it."""
_STOP_S = 1.0
"""What close() gives itself to stop serving after the final scrape."""


class PrometheusExporter(BaseExporter):
    """Serves the latest report on `http://addr:port/metrics` from a dedicated `CollectorRegistry`.

    Nothing is opened until `start()` or the first `describe()` (which only
    rank 0's hub makes); a port that cannot be bound raises `ExporterStartError`
    naming it. `port=0` picks a free port (read `.port` after start);
    `port=None` serves nothing and only registers the collector in `registry`,
    for an application that already serves that registry (create it with
    `support_collectors_without_names=True` for `name[]` filtering). The TLS
    options are prometheus_client's `start_http_server` options.

    At most `max_connections` scrape connections are served at once (more are
    closed at accept); each has `idle_timeout_s` to send its whole request and as
    long again to read the response, else it is closed.

    `close()` marks the run finished and keeps serving until the final report has been read whole by
    every scraper that has been scraping the endpoint (a client, by address and `User-Agent`, that
    read it unfiltered at least twice: `_final_scrape`), so the last values reach Prometheus whatever
    its scrape interval. It waits as long as each scraper's cadence says its next scrape takes
    (`final_scrape_due`: 1.5 intervals and a second after its last scrape; at most `linger_s` if
    given), past close's own `timeout_s` (about 91 s at Prometheus' default minute), and logs that
    it waits. It does not wait when nothing scraped the endpoint (a liveness probe, a `?name[]=`
    filtered GET or a single manual read is no scraper), when every scraper has read the final
    report already, or for a scraper that missed its cadence (it stopped). Then every connection and
    thread is gone: nothing keeps the process alive after `close()` returns. A new exporter on the
    same endpoint (`localhost` and `127.0.0.1` alike) ends a wait still going on in another thread.
    """

    def __init__(
        self,
        port: int | None = 9464,
        addr: str = "127.0.0.1",
        *,
        namespace: str = NAMESPACE,
        registry: Any = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        client_cafile: str | None = None,
        client_capath: str | None = None,
        client_auth_required: bool = False,
        linger_s: float | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        name: str = "prometheus",
    ) -> None:
        client = import_prometheus_client()
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(
                f"PrometheusExporter.port: must be in 0..65535 (0 picks a free port), got {port}"
            )
        if (certfile is None) != (keyfile is None):
            raise ValueError("PrometheusExporter: certfile and keyfile must be given together for TLS")
        if port is None and registry is None:
            raise ValueError("PrometheusExporter: port=None serves nothing; pass the registry= you serve")
        if (linger_s is not None and linger_s < 0) or not idle_timeout_s > 0:
            raise ValueError(
                f"PrometheusExporter: linger_s must be at least 0 and idle_timeout_s positive, got "
                f"linger_s={linger_s}, idle_timeout_s={idle_timeout_s}"
            )
        if max_connections < 1:
            raise ValueError(f"PrometheusExporter.max_connections: must be at least 1, got {max_connections}")
        super().__init__(name)
        # Without names of its own, the collector is found by `name[]` only in such a registry.
        self.registry = registry or client.CollectorRegistry(support_collectors_without_names=True)
        self.linger_s = linger_s
        self._limits = {"max_connections": max_connections, "idle_timeout_s": idle_timeout_s}
        self._port = port
        self._addr = addr
        self._tls = {
            "certfile": certfile,
            "keyfile": keyfile,
            "client_cafile": client_cafile,
            "client_capath": client_capath,
            "client_auth_required": client_auth_required,
        }
        self._collector = PrometheusCollector("scrape", namespace)
        self._registered = False
        self._server: ScrapeServer | None = None
        self._scrapes = ScrapeLog()
        self._closing_until: float | None = None

    @property
    def port(self) -> int | None:
        """The port served: the bound one after start (also for port=0), else the one asked for."""
        return self._server.port if self._server is not None else self._port

    @property
    def refused_connections(self) -> int:
        """Scrape connections closed at accept because `max_connections` were open."""
        return self._server.refused_connections if self._server is not None else 0

    @property
    def url(self) -> str | None:
        """`http(s)://addr:port/metrics` once serving, else None."""
        if self._server is None:
            return None
        scheme = "https" if self._tls["certfile"] else "http"
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return f"{scheme}://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Register the collector and serve (idempotent); `ExporterStartError` if the port is taken."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"PrometheusExporter {self.name!r}: start() after close()")
            if not self._registered:
                self.registry.register(self._collector)
                self._registered = True
            if self._port is None or self._server is not None:
                return
            if self._port:
                end_lingering(self._addr, self._port, self.name, _STOP_S + 1.0)
            try:
                self._server = ScrapeServer(
                    self._port,
                    self._addr,
                    self.registry,
                    on_delivered=self._delivered,
                    **self._limits,
                    **self._tls,
                )
            except OSError as error:
                raise ExporterStartError(
                    f"PrometheusExporter {self.name!r}: cannot serve on {self._addr} port {self._port} "
                    f"({error}); is another process (or run) using port {self._port}? pass another port=, "
                    "or port=0 for a free one"
                ) from error
            logger.info("PrometheusExporter %r: serving %s", self.name, self.url)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._collector.set_descriptors(descriptors, run)

    def _start(self, run: RunInfo) -> None:
        self.start()

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Make this report the one scrapes see."""
        problems = self._collector.set_report(step, values, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")

    def closing_until(self) -> float | None:
        """The `time.monotonic()` by which `close()`, running or called now, returns after waiting for
        the final scrape (the hub waits that long for it, past its deadline); None when it would not wait."""
        if self._closing_until is not None or self._server is None:
            return self._closing_until
        due = self._scrapers_due(
            self._collector.generation + 1, time.monotonic()
        )  # the final report is newer
        return max(due.values()) + _STOP_S if due else None

    def _delivered(self, scraper: Scraper | None, prometheus: bool) -> None:
        """A scrape was sent whole: note what a scraper read (a filtered read is no scrape)."""
        generation = self._collector.taken_reading()
        if scraper is not None and generation is not None:
            self._scrapes.delivered(scraper, generation, prometheus=prometheus)

    def _close(self, timeout_s: float) -> None:
        """Mark the run finished, serve until its scrapers have read the final report, stop, unregister."""
        deadline = time.monotonic() + timeout_s
        self._collector.set_finished(wall_time())
        url, server = self.url, self._server
        if server is None:
            self._stop(None, 0.0)
            return
        final, now = self._collector.generation, time.monotonic()
        due = self._scrapers_due(final, now)
        self._closing_until = max(due.values()) + _STOP_S if due else None  # before closing_until() sees
        self._server = None  # no server: it reads _closing_until from here on
        try:
            with lingering(self._addr, server.port, self._scrapes):  # until the port is free again
                if due:
                    self._serve_final_report(url, final, due)
                self._stop(server, max(_STOP_S, deadline - time.monotonic()))
        finally:
            self._closing_until = None

    def _stop(self, server: ScrapeServer | None, timeout_s: float) -> None:
        if self._registered:
            self._registered = False
            self.registry.unregister(self._collector)
        if server is not None and not server.close(timeout_s):
            logger.warning("PrometheusExporter %r: scrape connections still open after close", self.name)

    def _serve_final_report(self, url: str | None, final: int, due: Mapping[Scraper, float]) -> None:
        """Serve until every scraper of `due` has read report `final` or missed its next scrape (at
        most `linger_s`), past close's timeout."""
        if not self._scrapes.wait(final, due, until=time.monotonic() + _IN_FLIGHT_S):
            return  # read already, by scrapes still sending it
        logger.info(
            "PrometheusExporter %r: waiting up to %.0f s for %s to read the final report at %s (the next "
            "scrape is due then, at the cadence seen; close() waits past its timeout for it)",
            self.name,
            max(due.values()) - time.monotonic(),
            _names(due),
            url,
        )
        unread = self._scrapes.wait(final, due)
        if unread:
            logger.warning(
                "PrometheusExporter %r: %s did not read the final report by the time its next scrape was due "
                "(or a new exporter took the port); closing without it",
                self.name,
                _names(unread),
            )

    def _scrapers_due(self, generation: int, now: float) -> dict[Scraper, float]:
        """The scrapers to wait for to read report `generation`, with their due times (capped by linger_s)."""
        due = self._scrapes.due(generation, now)
        if self.linger_s is None:
            return due
        return {scraper: min(at, now + self.linger_s) for scraper, at in due.items() if self.linger_s > 0}


def _names(scrapers: Iterable[Scraper]) -> str:
    """`127.0.0.1 (Prometheus/2.45.0)`, ... for the log."""
    return ", ".join(f"{address} ({agent or 'no User-Agent'})" for address, agent in scrapers)
