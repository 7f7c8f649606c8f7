"""The scrape endpoint's HTTP server: prometheus_client's, with bounded connections and idle time.

prometheus_client's server starts one handler thread per connection, with no cap and no
timeout: 200 idle sockets hold 200 threads, still alive after shutdown. `ScrapeServer` admits
at most `max_connections` at once (more are closed at accept and counted), closes a connection
idle for `idle_timeout_s`, and on `close()` ends every open connection and joins its thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torchtelemetry.export._base import LogThrottle
from torchtelemetry.export._exposition import import_prometheus_client, openmetrics_handler

__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "HANDLER_THREAD_PREFIX", "ScrapeServer"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 16
"""Scrape connections served at once; more are closed at accept."""
DEFAULT_IDLE_TIMEOUT_S = 10.0
"""A scrape connection that sends or reads nothing for this long is closed."""
HANDLER_THREAD_PREFIX = "torchtelemetry-scrape"
"""Name prefix of the threads serving scrape connections."""
_REFUSAL_LOG_INTERVAL_S = 60.0


class ScrapeServer:
    """Serves `registry` on `addr:port` until `close()`; raises `OSError` if the port cannot be bound.

    `on_delivered` is called on the handler thread after a response was sent whole.
    """

    def __init__(
        self,
        port: int,
        addr: str,
        registry: Any,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        on_delivered: Callable[[], None] | None = None,
        **tls: Any,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._on_delivered = on_delivered
        self._request = threading.local()
        self._lock = threading.Lock()
        self._open: dict[Any, threading.Thread | None] = {}
        self._refusal_log = LogThrottle(_REFUSAL_LOG_INTERVAL_S)
        self.refused_connections = 0
        """Connections closed at accept because `max_connections` were open."""
        client = import_prometheus_client()
        self._server, self._thread = client.start_http_server(port, addr=addr, registry=registry, **tls)
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
        for connection in connections:
            with contextlib.suppress(OSError):  # unblocks a handler reading from or writing to it
                connection.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        threads = [self._thread, *(thread for thread in connections.values() if thread is not None)]
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
        try:
            self._process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._open.pop(request, None)
            self._slots.release()
            raise

    def _serve(self, request: Any, client_address: Any) -> None:
        threading.current_thread().name = f"{HANDLER_THREAD_PREFIX}-{self.port}"
        with self._lock:
            self._open[request] = threading.current_thread()
        self._request.failed = False
        try:
            self._process_request_thread(request, client_address)  # the response is sent and the socket shut
        finally:
            with self._lock:
                self._open.pop(request, None)
            self._slots.release()
        if not self._request.failed and self._on_delivered is not None:
            self._on_delivered()

    def _handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or went away is routine: logged at debug, not printed."""
        self._request.failed = True
        logger.debug("scrape connection from %s ended with an error", client_address[0], exc_info=True)
