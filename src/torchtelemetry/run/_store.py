"""The heartbeat store: where it is, how a value is written on it, and calls that always return.

Each rank sets its heartbeat under `torchtelemetry/<token>/heartbeat/<rank>` (the token is new for
every `Telemetry`) as `count|step|phase|stalled_s|dump|mac`, the mac a keyed BLAKE2b of the key and
the rest under a secret the ranks agree on at start-up: a value that fails it, or does not parse,
is refused (`BadValue`), never trusted.

The store is the job's own rendezvous store where the process group has a TCP one (torchrun's, or
`MASTER_ADDR:MASTER_PORT`): each rank opens a connection of its own to it. Otherwise the exporting
rank hosts a `torch.distributed.TCPStore` on the interface the process group uses and on
`heartbeat_port`. A store call against a host that stopped answering blocks inside torch for good,
so every call runs on a `StoreLink`'s thread and returns (or raises `StoreUnavailable`) in time.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.distributed as dist

from torchtelemetry.run._hangs import Reading

__all__ = [
    "KEYS_PER_READ",
    "BadValue",
    "StoreLink",
    "StoreUnavailable",
    "decode_heartbeat",
    "encode_heartbeat",
    "heartbeat_key",
    "host_store",
    "interface_address",
    "job_store_address",
    "join_store",
]

logger = logging.getLogger(__name__)

KEYS_PER_READ = 1024
"""Heartbeats read by one `multi_get`: TCPStore's grows faster than linearly with its keys (16,384
keys take ~40x the time of 1,024 keys, 16 times over), so wider worlds are read in chunks."""
MAX_VALUE_BYTES = 4096
"""A heartbeat is about 80 bytes with its mac; a longer value is refused unread."""
_MAC_CHARS = 32


class BadValue(ValueError):
    """A heartbeat value that failed its authenticator or does not parse."""


class StoreUnavailable(RuntimeError):
    """A store call that failed, did not return in time, or waits behind one that did not."""


def heartbeat_key(token: str, rank: int) -> str:
    """The store key of `rank`'s heartbeat in the run of `token`."""
    return f"torchtelemetry/{token}/heartbeat/{rank}"


def _mac(secret: bytes, key: str, payload: str) -> str:
    """Keyed BLAKE2b (a MAC by design, four times cheaper than HMAC-SHA256 here) of key and payload."""
    return hashlib.blake2b(f"{key}\n{payload}".encode(), key=secret, digest_size=_MAC_CHARS // 2).hexdigest()


def encode_heartbeat(secret: bytes, key: str, reading: Reading) -> str:
    """`reading` as stored under `key`: `count|step|phase|stalled_s|dump|mac` (phases are path
    segments, without `|`)."""
    payload = f"{reading.count}|{reading.step}|{reading.phase}|{reading.stalled_s:.3f}|{reading.dump}"
    return f"{payload}|{_mac(secret, key, payload)}"


def decode_heartbeat(secret: bytes, key: str, value: bytes) -> Reading | None:
    """`encode_heartbeat`'s reading back (None for the empty value set before any heartbeat);
    `BadValue` when it fails its mac or does not parse."""
    if not value:
        return None
    if len(value) > MAX_VALUE_BYTES:
        raise BadValue(f"{len(value)} bytes, longer than any heartbeat")
    try:
        payload, mac = value.decode().rsplit("|", 1)
    except (UnicodeDecodeError, ValueError):
        raise BadValue("not a heartbeat") from None
    if not hmac.compare_digest(mac, _mac(secret, key, payload)):
        raise BadValue("its authenticator does not match (not written by a rank of this run)")
    fields = payload.split("|", 4)
    if len(fields) != 5:
        raise BadValue(f"{len(fields)} fields, not 5")
    count, step, phase, stalled_s, dump = fields
    try:
        return Reading(int(count), int(step), phase, float(stalled_s), dump)
    except ValueError:
        raise BadValue("a count, step or duration that is not a number") from None


class StoreLink:
    """A store whose calls return within `timeout_s`: each runs on this link's daemon thread
    (`name`); the caller waits for it at most that long. `connect(timeout_s)` opens the store on that
    thread at the first call and again after a call failed (a reset connection is opened anew),
    trying for the call's bound; a `store` given instead (one this process hosts) is kept. While a
    call has not returned, later calls raise `StoreUnavailable` at once. Closing the link drops the
    store."""

    def __init__(
        self, connect: Callable[[float], Any] | None, *, name: str, timeout_s: float, store: Any = None
    ) -> None:
        self._connect = connect
        self.timeout_s = timeout_s
        self._store: Any = store
        """The store (one given without `connect` is kept after a failed call)."""
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._pending: Future | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            work, future = call
            try:
                future.set_result(work())
            except BaseException as error:  # handed to the caller, who decides
                future.set_exception(error)
        self._store = None  # a hosted store's port closes once nothing holds it

    def connect(self, timeout_s: float | None = None) -> None:
        """Open the store now (within `timeout_s`, default the link's)."""
        self._call(self._opened, self.timeout_s if timeout_s is None else timeout_s)

    def call(self, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`store.<op>(*args)`, within `timeout_s` (default the link's)."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        return self._call(lambda store_s: getattr(self._opened(store_s), op)(*args), wait_s)

    def _opened(self, timeout_s: float) -> Any:
        if self._store is None:
            if self._connect is None:
                raise StoreUnavailable("the heartbeat store is closed")
            self._store = self._connect(timeout_s)
        return self._store

    def _call(self, work: Callable[[float], Any], wait_s: float) -> Any:
        if self._pending is not None and not self._pending.done():
            raise StoreUnavailable("an earlier call to the heartbeat store has not returned")
        future: Future = Future()
        self._pending = future
        self._calls.put((lambda: self._failing_anew(work, wait_s), future))
        try:
            return future.result(wait_s)
        except FutureTimeout:
            raise StoreUnavailable(f"the heartbeat store did not answer within {wait_s:g} s") from None
        except StoreUnavailable:
            raise
        except Exception as error:
            raise StoreUnavailable(f"{type(error).__name__}: {error}") from error

    def _failing_anew(self, work: Callable[[float], Any], timeout_s: float) -> Any:
        try:
            return work(timeout_s)
        except Exception:
            if self._connect is not None:
                self._store = None  # open it anew at the next call
            raise

    def close(self, timeout_s: float) -> bool:
        """Stop the thread (dropping the store); False when a call still blocks it after `timeout_s`
        (a host that stopped answering: the thread ends when the call does)."""
        self._calls.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def job_store_address() -> tuple[str, int] | None:
    """The host and port of the process group's own rendezvous store when it is a TCPStore
    (torchrun's, `MASTER_ADDR:MASTER_PORT`, `tcp://`); None for a file or custom store."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or torch's private helper moved: host our own
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def interface_address() -> str:
    """This host's address on the interface the process group uses: the one that routes to the
    launcher's rendezvous host (`MASTER_ADDR`), else to the address the host name resolves to (the
    one gloo takes by default); loopback when neither resolves."""
    target = os.environ.get("MASTER_ADDR") or socket.gethostname()
    try:
        family, _, _, _, address = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: nothing is sent, the kernel only picks the route's source
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def host_store(address: str, port: int, timeout_s: float) -> tuple[Any, int]:
    """A TCPStore listening on `address:port` only (port 0: one the kernel picks), and its port."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(128)
        bound = listener.getsockname()[1]
        store = dist.TCPStore(
            address,
            bound,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket and closes it when it goes
    return store, bound


def join_store(address: tuple[str, int], timeout_s: float) -> Any:
    """A connection of this rank's own to the store at `address`."""
    host, port = address
    return dist.TCPStore(
        host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
