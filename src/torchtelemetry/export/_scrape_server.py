"""The scrape endpoint's HTTP server: prometheus_client's, with bounded connections and time.

prometheus_client's server starts one handler thread per connection, with no cap and no
timeout: 200 idle sockets hold 200 threads, still alive after shutdown. `ScrapeServer` admits
at most `max_connections` at once (more are closed at accept and counted), and on `close()`
ends every open connection and joins its thread. Each connection has `idle_timeout_s` in all
to send its whole request (headers included), then as long again to read the response: a
deadline, kept by one watcher thread, not a timeout per `recv`, so a client trickling a byte
now and then (slowloris) cannot hold a slot for longer.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from torchtelemetry.export._base import LogThrottle
from torchtelemetry.export._exposition import import_prometheus_client, openmetrics_handler

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "HANDLER_THREAD_PREFIX", "ScrapeServer"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 16
"""Scrape connections served at once; more are closed at accept."""
DEFAULT_IDLE_TIMEOUT_S = 10.0
"""Time a scrape connection has to send its whole request, and again to read the response."""
HANDLER_THREAD_PREFIX = "torchtelemetry-scrape"
"""Name prefix of the threads serving scrape connections."""
_REFUSAL_LOG_INTERVAL_S = 60.0


class ScrapeServer:
    """Serves `registry` on `addr:port` until `close()`; raises `OSError` if the port cannot be bound.

    `on_delivered(scraper, prometheus)` is called on the handler thread after a response was sent
    whole: `scraper` is the client, `(address, User-Agent)`, when it read the whole exposition (a
    GET without a `name[]` filter), else None (a filtered or partial read); `prometheus` says that
    it sent Prometheus' `X-Prometheus-Scrape-Timeout-Seconds` header.
    """

    def __init__(
        self,
        port: int,
        addr: str,
        registry: Any,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        on_delivered: Callable[[tuple[str, str] | None, bool], None] | None = None,
        **tls: Any,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._on_delivered = on_delivered
        self._request = threading.local()
        self._lock = threading.Condition()
        self._open: dict[Any, threading.Thread | None] = {}
        self._deadlines: dict[Any, float] = {}
        """Open connections by the monotonic time at which the watcher shuts them."""
        self._closing = False
        self._refusal_log = LogThrottle(_REFUSAL_LOG_INTERVAL_S)
        self._deadline_log = LogThrottle(_REFUSAL_LOG_INTERVAL_S)
        self.refused_connections = 0
        """Connections closed at accept because `max_connections` were open."""
        self.timed_out_connections = 0
        """Connections closed because their request (or the response) took over `idle_timeout_s`."""
        client = import_prometheus_client()
        self._server, self._thread = client.start_http_server(port, addr=addr, registry=registry, **tls)
        app = self._server.get_app()
        self._server.set_app(lambda environ, start_response: self._answer(app, environ, start_response))
        self._watcher = threading.Thread(
            target=self._watch, name=f"torchtelemetry-deadlines-{self.port}", daemon=True
        )
        self._watcher.start()
        # socketserver looks both up on the instance: every later connection goes through them.
        self._process_request = self._server.process_request
        self._process_request_thread = self._server.process_request_thread
        self._server.process_request = self._admit
        self._server.process_request_thread = self._serve
        self._server.handle_error = self._handle_error
        self._server.RequestHandlerClass = openmetrics_handler(self._server.RequestHandlerClass)
        self._server.block_on_close = False  # close() joins the handler threads itself, under its deadline

    @property
    def port(self) -> int:
        """The bound port."""
        return self._server.server_port

    def open_connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._open)

    def close(self, timeout_s: float) -> bool:
        """Stop accepting, end every open connection and join the threads; True if all ended in time."""
        deadline = time.monotonic() + timeout_s
        self._server.shutdown()
        with self._lock:
            connections = dict(self._open)
            self._closing = True
            self._lock.notify_all()
        for connection in connections:
            with contextlib.suppress(OSError):  # unblocks a handler reading from or writing to it
                connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        threads = [
            self._thread,
            self._watcher,
            *(thread for thread in connections.values() if thread is not None),
        ]
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def _admit(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            if self._refusal_log.due():
                logger.warning(
                    "scrape endpoint on port %d: %d connections open (max_connections), closing a new "
                    "one from %s; %d refused so far (logged at most every %.0f s)",
                    self.port,
                    self._max_connections,
                    client_address[0],
                    self.refused_connections,
                    _REFUSAL_LOG_INTERVAL_S,
                )
            self._server.shutdown_request(request)
            return
        request.settimeout(self._idle_timeout_s)
        with self._lock:
            self._open[request] = None  # until its thread runs: close() must end it too
            self._deadlines[request] = time.monotonic() + self._idle_timeout_s
            self._lock.notify_all()
        try:
            self._process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._open.pop(request, None)
                self._deadlines.pop(request, None)
            self._slots.release()
            raise

    def _serve(self, request: Any, client_address: Any) -> None:
        threading.current_thread().name = f"{HANDLER_THREAD_PREFIX}-{self.port}"
        with self._lock:
            self._open[request] = threading.current_thread()
        self._request.failed = False
        self._request.connection = request
        self._request.scraper = None
        self._request.prometheus = False
        try:
            self._process_request_thread(request, client_address)  # the response is sent and the socket shut
        finally:
            with self._lock:
                self._open.pop(request, None)
                self._deadlines.pop(request, None)
            self._slots.release()
        if not self._request.failed and self._on_delivered is not None:
            self._on_delivered(self._request.scraper, self._request.prometheus)

    def _answer(self, app: Callable[..., Any], environ: Any, start_response: Any) -> Any:
        """The request was read whole: the response gets `idle_timeout_s` of its own."""
        whole = environ.get("REQUEST_METHOD") == "GET" and "name[]" not in parse_qs(
            environ.get("QUERY_STRING", "")
        )
        if whole:
            self._request.scraper = (environ.get("REMOTE_ADDR", ""), environ.get("HTTP_USER_AGENT", ""))
            self._request.prometheus = "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS" in environ
        with self._lock:
            if self._request.connection in self._deadlines:
                self._deadlines[self._request.connection] = time.monotonic() + self._idle_timeout_s
        return app(environ, start_response)

    def _watch(self) -> None:
        """Shut every connection whose deadline has passed, until `close()`."""
        with self._lock:
            while not self._closing:
                now = time.monotonic()
                expired = [connection for connection, due in self._deadlines.items() if due <= now]
                for connection in expired:
                    del self._deadlines[connection]
                    with contextlib.suppress(OSError):  # its handler then ends at once
                        connection.shutdown(socket.SHUT_RDWR)
                if expired:
                    self.timed_out_connections += len(expired)
                    if self._deadline_log.due():
                        logger.warning(
                            "scrape endpoint on port %d: closed %d connection(s) that took over "
                            "idle_timeout_s=%gs to send a request or read the response; %d so far "
                            "(logged at most every %.0f s)",
                            self.port,
                            len(expired),
                            self._idle_timeout_s,
                            self.timed_out_connections,
                            _REFUSAL_LOG_INTERVAL_S,
                        )
                self._lock.wait(min(self._deadlines.values(), default=now + 60.0) - now)

    def _handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or went away is routine: logged at debug, not printed."""
        self._request.failed = True
        logger.debug("scrape connection from %s ended with an error", client_address[0], exc_info=True)
