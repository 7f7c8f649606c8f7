"""Fault peers for reliability tests: a TCP proxy a test switches between up, down, hanging and slow.

    with PushgatewayServer(tmp_path) as gateway, FaultProxy(gateway.port) as link:
        exporter = PushgatewayExporter(link.url, timeout_s=0.5)   # talks to the gateway through the link
        link.down()      # connections refused, open ones dropped: a crashed backend
        link.hang()      # connections accepted, nothing ever answered: a wedged backend (a "black hole")
        link.slow(2.0)   # every answer delayed by 2 s
        link.up()        # forwarding again, on the same port

The proxy binds 127.0.0.1 on a free port and works for any protocol over TCP
(HTTP/1.1, gRPC's HTTP/2). Every mode change drops the open connections, as a
backend restart would, so clients reconnect and meet the new behaviour.
`FaultProxy()` with no upstream is a black hole (or, after `down()`, a closed port).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Literal

from tests.distributed import free_port

__all__ = ["FaultProxy", "Mode"]

Mode = Literal["up", "down", "hang", "slow"]


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of `127.0.0.1:upstream_port`, whose behaviour the test switches.

    `accepted` counts the connections accepted so far (in any mode but down), so
    a test can check that a client really reached the fault.
    """

    def __init__(self, upstream_port: int | None = None, *, port: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = port or free_port()
        self.accepted = 0
        self._mode: Mode = "up" if upstream_port is not None else "hang"
        self._delay_s = 0.0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """`127.0.0.1:<port>`."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://{self.address}"

    @property
    def mode(self) -> Mode:
        """The current behaviour."""
        return self._mode

    # -- switching ------------------------------------------------------------------------

    def up(self) -> None:
        """Forward every connection to the upstream."""
        self._switch("up", 0.0)

    def down(self) -> None:
        """Close the port: connections are refused until another mode is set."""
        self._switch("down", 0.0)

    def hang(self) -> None:
        """Accept connections and never answer nor forward anything."""
        self._switch("hang", 0.0)

    def slow(self, delay_s: float) -> None:
        """Forward, but hold back everything the upstream sends by `delay_s`."""
        self._switch("slow", delay_s)

    def _switch(self, mode: Mode, delay_s: float) -> None:
        if mode in ("up", "slow") and self.upstream_port is None:
            raise ValueError(f"FaultProxy.{mode}: no upstream_port to forward to")
        with self._lock:
            self._mode, self._delay_s = mode, delay_s
            self._drop_connections()
            if self._thread is None:
                return
            if mode == "down":
                self._close_listener()
            elif self._listener is None:
                self._listener = self._listen()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen (unless down) and serve on a daemon thread."""
        with self._lock:
            if self._thread is not None:
                return self
            if self._mode != "down":
                self._listener = self._listen()
            self._stopped.clear()
            self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Close the port and every connection; safe to call twice."""
        self._stopped.set()
        with self._lock:
            thread, self._thread = self._thread, None
            self._close_listener()
            self._drop_connections()
        if thread is not None:
            thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------------

    def _listen(self) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        return listener

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _drop_connections(self) -> None:
        connections, self._connections = self._connections, set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            listener = self._listener
            if listener is None:
                self._stopped.wait(0.02)
                continue
            try:
                client, _ = listener.accept()
            except OSError:  # timeout, or the listener was closed by a mode change
                continue
            self._handle(client)

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(None)
        with self._lock:
            self.accepted += 1
            mode, port = self._mode, self.upstream_port
            self._connections.add(client)
        if mode != "up" and mode != "slow":
            return  # hang: hold the connection open, read nothing, answer nothing
        assert port is not None
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            self._close(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self._connections.add(upstream)
        for source, target, delayed in ((client, upstream, False), (upstream, client, True)):
            threading.Thread(
                target=self._pump, args=(source, target, delayed), name="fault-proxy-pump", daemon=True
            ).start()

    def _pump(self, source: socket.socket, target: socket.socket, delayed: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if delayed and self._delay_s > 0 and self._stopped.wait(self._delay_s):
                    break
                target.sendall(data)
        except OSError:
            pass
        finally:
            self._close(source)
            self._close(target)

    def _close(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_RDWR)
        connection.close()
