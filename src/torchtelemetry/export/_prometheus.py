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
from torchtelemetry.export._protocol import ExporterStartError, RunInfo
from torchtelemetry.export._scrape_server import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ScrapeServer
from torchtelemetry.report import NAMESPACE, MetricDescriptor, Scalars

__all__ = ["DEFAULT_LINGER_S", "PrometheusExporter"]

logger = logging.getLogger(__name__)

DEFAULT_LINGER_S = 15.0
"""How long `PrometheusExporter.close()` keeps serving for a scrape of the final report."""
_IN_FLIGHT_S = 2.0
"""Before saying it lingers, close() lets a scrape that has read the final report finish sending it."""


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
    closed at accept) and one idle for `idle_timeout_s` is closed. `close()`
    marks the run finished and, if anything has scraped the endpoint, keeps
    serving until a scrape has read the final report, at most `linger_s` (and
    within close's own timeout), so the last values reach Prometheus; it logs
    that it waits. Then every connection and thread is gone.
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
        if linger_s < 0 or not idle_timeout_s > 0:
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
                    on_delivered=self._collector.delivered,
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

    def _export(self, step: int, scalars: Scalars, timestamp: float) -> None:
        """Make this report the one scrapes see."""
        problems = self._collector.set_report(step, scalars, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")

    def _close(self, timeout_s: float) -> None:
        """Mark the run finished, linger for a scrape of the final report, stop serving, unregister."""
        deadline = time.monotonic() + timeout_s
        self._collector.set_finished(time.time())
        if self._server is not None:
            self._linger(min(self.linger_s, timeout_s - 1.0))  # a second of close's timeout to stop
        server, self._server = self._server, None
        if self._registered:
            self._registered = False
            self.registry.unregister(self._collector)
        if server is not None and not server.close(max(0.0, deadline - time.monotonic())):
            logger.warning("PrometheusExporter %r: scrape connections still open after close", self.name)

    def _linger(self, linger_s: float) -> None:
        """Keep serving until a scrape has read the final report, if anything scrapes this endpoint."""
        if self._collector.scrapes == 0 or linger_s <= 0:
            return  # nobody scrapes it
        if self._collector.wait_for_scrape(min(linger_s, _IN_FLIGHT_S)):
            return  # the final report was read already, or by a scrape still sending it
        logger.info(
            "PrometheusExporter %r: waiting up to %.0f s (linger_s) for a scrape of the final report at %s",
            self.name,
            linger_s,
            self.url,
        )
        if not self._collector.wait_for_scrape(linger_s):
            logger.warning(
                "PrometheusExporter %r: no scrape read the final report within %.0f s; raise linger_s "
                "to at least the scrape interval",
                self.name,
                linger_s,
            )
