"""`PrometheusExporter`: rank 0 serves `/metrics`, one consistent step per scrape.

The families come from `PrometheusCollector` (`_exposition.py`), the server from
`ScrapeServer` (`_scrape_server.py`); this module starts, serves and closes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._exposition import PrometheusCollector, import_prometheus_client
from torchtelemetry.export._final_scrape import DEFAULT_LINGER_S, STOP_S, FinalScrapeWait, Scraper
from torchtelemetry.export._naming import NAMESPACE
from torchtelemetry.export._protocol import ExporterStartError, RunInfo
from torchtelemetry.export._scrape_server import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ScrapeServer
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = ["PrometheusExporter"]

logger = logging.getLogger(__name__)


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

    `close()` marks the run finished and keeps serving until the run's scraper has read the final
    report whole, so the last values reach Prometheus (`_final_scrape`, `FinalScrapeWait`): a client
    that reads the whole exposition at a steady cadence (three reads at one interval, or a Prometheus
    from its first read) whose next scrape is due within `linger_s` (75 s: a Prometheus at its
    default 60 s interval is). It waits past close's own `timeout_s` until that scraper has read the
    final report or let its next scrape pass, at most `linger_s`, and logs that it waits; it does not
    wait at all for a client that is not such a scraper (two manual reads, a `?name[]=` filtered
    GET, a probe every 15 minutes), when every scraper has read the final report already, or with
    `linger_s=0`. Then every connection and thread is gone: nothing keeps the process alive after
    `close()` returns, and the port is free.
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
        linger_s: float = DEFAULT_LINGER_S,
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
        if not (linger_s >= 0 and idle_timeout_s > 0):
            raise ValueError(
                f"PrometheusExporter: linger_s must be at least 0 and idle_timeout_s positive, got "
                f"linger_s={linger_s}, idle_timeout_s={idle_timeout_s}"
            )
        if max_connections < 1:
            raise ValueError(f"PrometheusExporter.max_connections: must be at least 1, got {max_connections}")
        super().__init__(name)
        # Without names of its own, the collector is found by `name[]` only in such a registry.
        self.registry = registry or client.CollectorRegistry(support_collectors_without_names=True)
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
        self.final_scrape = FinalScrapeWait(linger_s)
        """How long `close()` serves the final report, and for whom."""

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

    def destination(self) -> str | None:
        return self.url

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._collector.set_descriptors(descriptors, run)

    def _start(self, run: RunInfo) -> None:
        self.start()

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Make this report the one scrapes see."""
        problems = self._collector.set_report(step, values, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")

    def _retire(self, names: frozenset[str]) -> None:
        self._collector.retire(names)

    def closing_until(self) -> float | None:
        """While `close()` serves the final report, or if called now, the `time.monotonic()` by which
        it returns (`FinalScrapeWait.closing_until`); None when it does not wait."""
        return self.final_scrape.closing_until(self._collector.generation + 1)  # the final report is newer

    def _delivered(self, scraper: Scraper | None, prometheus: bool) -> None:
        """A scrape was sent whole: note what a client read (a filtered read is no scrape)."""
        generation = self._collector.taken_reading()
        if scraper is not None and generation is not None:
            self.final_scrape.delivered(scraper, generation, prometheus=prometheus)

    def _close(self, timeout_s: float) -> None:
        """Mark the run finished, serve until its scraper has read the final report, stop, unregister."""
        deadline = time.monotonic() + timeout_s
        self._collector.set_finished(wall_time())
        server = self._server
        if server is not None:
            self.final_scrape.serve(self._collector.generation, f"PrometheusExporter {self.name!r}", self.url)
        self._server = None
        if self._registered:
            self._registered = False
            self.registry.unregister(self._collector)
        if server is not None and not server.close(max(STOP_S, deadline - time.monotonic())):
            logger.warning("PrometheusExporter %r: scrape connections still open after close", self.name)
