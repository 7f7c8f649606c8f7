"""`PrometheusExporter`: rank 0 serves `/metrics`, one consistent step per scrape.

The families come from `PrometheusCollector` (`_exposition.py`), the server from
`ScrapeServer` (`_scrape_server.py`); this module starts, serves and closes them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._exposition import PrometheusCollector, import_prometheus_client
from torchtelemetry.export._naming import NAMESPACE
from torchtelemetry.export._protocol import ExporterStartError, RunInfo
from torchtelemetry.export._scrape_server import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ScrapeServer
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = ["PrometheusExporter", "final_scrape_due"]

logger = logging.getLogger(__name__)

UNKNOWN_INTERVAL_S = 60.0
"""The scrape interval assumed after a single scrape: Prometheus' default `scrape_interval`."""
_IN_FLIGHT_S = 2.0
"""Before saying it waits, close() lets a scrape that has read the final report finish sending it."""
_STOP_S = 1.0
"""What close() keeps of its timeout to stop serving."""
_lingering: dict[tuple[str, int], tuple[threading.Event, threading.Thread]] = {}
"""Endpoints still serving a closed run's final report in the background, by (addr, port)."""
_lingering_lock = threading.Lock()


def final_scrape_due(delivered_at: Sequence[float], now: float) -> float | None:
    """The `time.monotonic()` by which a scraper keeping its cadence has read the endpoint again, or None
    when nothing ever scraped it or its scraper has stopped.

    Prometheus scrapes a target at a fixed interval: the cadence is the median gap between the
    scrapes seen, and the next scrape is due one interval after the last, with half an interval and
    a second of slack (after a single scrape, `UNKNOWN_INTERVAL_S` and a second). A scraper that let
    that pass has stopped (a removed target, a Prometheus gone): nothing is coming, nothing is waited for.
    """
    if not delivered_at:
        return None
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(delivered_at))
    due = delivered_at[-1] + (1.5 * gaps[len(gaps) // 2] if gaps else UNKNOWN_INTERVAL_S) + 1.0
    return due if due > now else None


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

    `close()` marks the run finished and keeps serving until a scrape has read
    the final report, so the last values reach Prometheus whatever its scrape
    interval: it waits as long as the scrape cadence it has seen says the next
    scrape takes (`final_scrape_due`; at most `linger_s` if given), and it logs
    that it waits. It does not wait when nothing ever scraped the endpoint, when
    a scrape has read the final report already, or when the scraper has stopped
    (missed its cadence). Past close's own timeout the endpoint goes on serving the
    final report from a background thread until that scrape (the process exits
    after it), and a new exporter on the same port ends it. Then every connection
    and thread is gone.
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
            _end_linger(self._addr, self._port, self.name)
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

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Make this report the one scrapes see."""
        problems = self._collector.set_report(step, values, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")

    def _close(self, timeout_s: float) -> None:
        """Mark the run finished, serve until a scrape has read the final report, stop, unregister."""
        deadline = time.monotonic() + timeout_s
        self._collector.set_finished(wall_time())
        url, server, self._server = self.url, self._server, None
        if server is not None and not self._final_report_read(server, url, deadline - _STOP_S):
            return  # a background thread serves the final report until its scrape, then stops
        self._stop(server, max(0.0, deadline - time.monotonic()))

    def _stop(self, server: ScrapeServer | None, timeout_s: float) -> None:
        if self._registered:
            self._registered = False
            self.registry.unregister(self._collector)
        if server is not None and not server.close(timeout_s):
            logger.warning("PrometheusExporter %r: scrape connections still open after close", self.name)

    def _final_report_read(self, server: ScrapeServer, url: str | None, stop_by: float) -> bool:
        """Wait for a scrape of the final report until the next scrape is due (or `stop_by`).

        False when close's time ran out first: the wait goes on in a background thread."""
        now = time.monotonic()
        due = final_scrape_due(self._collector.delivered_at(), now)
        if due is not None and self.linger_s is not None:
            due = min(due, now + self.linger_s)
        if due is None or due <= now:
            return True  # nothing scrapes this endpoint (any more): nothing to wait for
        if self._collector.wait_for_scrape(min(_IN_FLIGHT_S, due - now)):
            return True  # read already, or by a scrape still sending it
        logger.info(
            "PrometheusExporter %r: waiting up to %.0f s for a scrape of the final report at %s (the next "
            "scrape is due then, at the cadence seen)",
            self.name,
            due - time.monotonic(),
            url,
        )
        if self._collector.wait_for_scrape(max(0.0, min(due, stop_by) - time.monotonic())):
            return True
        if due <= stop_by:
            logger.warning(
                "PrometheusExporter %r: no scrape read the final report by the time the next one was due; "
                "closing without it",
                self.name,
            )
            return True
        self._linger_in_background(server, due)
        return False

    def _linger_in_background(self, server: ScrapeServer, due: float) -> None:
        stop = threading.Event()
        key = (self._addr, server.port)

        def serve() -> None:
            while not stop.is_set() and time.monotonic() < due:
                if self._collector.wait_for_scrape(min(0.2, max(0.0, due - time.monotonic()))):
                    break
            self._stop(server, _STOP_S)
            with _lingering_lock:
                if _lingering.get(key, (None,))[0] is stop:
                    del _lingering[key]

        # Not a daemon: the process does not exit before the final report is scraped.
        thread = threading.Thread(
            target=serve, name=f"torchtelemetry-final-scrape-{server.port}", daemon=False
        )
        with _lingering_lock:
            _lingering[key] = (stop, thread)
        thread.start()
        logger.warning(
            "PrometheusExporter %r: close() ran out of time before the final report was scraped; the "
            "endpoint keeps serving it until the next scrape (due in %.0f s), and the process exits after it",
            self.name,
            due - time.monotonic(),
        )


def _end_linger(addr: str, port: int, name: str) -> None:
    """Stop serving a closed run's final report on `addr:port`, for a new exporter to bind it."""
    with _lingering_lock:
        lingering = _lingering.pop((addr, port), None) if port else None
    if lingering is None:
        return
    stop, thread = lingering
    logger.warning(
        "PrometheusExporter %r: port %d still served the final report of a closed run; it is not scraped now",
        name,
        port,
    )
    stop.set()
    thread.join(_STOP_S + 1.0)
