"""The heartbeat store's parts: the authenticated wire format, calls that return against a store
that never answers, a failed write retried, and the monitor counting refused values and unwatched
ranks (each on a clock the test moves). tests/reliability/test_heartbeat_store.py has the store of
real process groups: forged values from another process, ports closed at close()."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from torchtelemetry.run import Heartbeat, Reading
from torchtelemetry.run._dumps import DumpFiles
from torchtelemetry.run._heartbeat import HeartbeatPublisher
from torchtelemetry.run._monitor import HangMonitor, Judging
from torchtelemetry.run._store import (
    BadValue,
    StoreLink,
    StoreUnavailable,
    decode_heartbeat,
    encode_heartbeat,
    heartbeat_key,
    interface_address,
    join_store,
)

SECRET = b"s" * 32
KEY = heartbeat_key("0123abcd", 1)
PHASES = ("forward", "backward", "optimizer")


def test_a_heartbeat_reads_back_only_under_its_key_and_secret() -> None:
    reading = Reading(7, 120, "backward", 3.25, "/tmp/a|b.txt")
    value = encode_heartbeat(SECRET, KEY, reading).encode()
    assert decode_heartbeat(SECRET, KEY, value) == reading
    assert decode_heartbeat(SECRET, KEY, b"") is None  # set empty before the rank's first heartbeat
    with pytest.raises(BadValue, match="authenticator"):
        decode_heartbeat(b"t" * 32, KEY, value)  # another run's secret
    with pytest.raises(BadValue, match="authenticator"):
        decode_heartbeat(SECRET, heartbeat_key("0123abcd", 2), value)  # another rank's key
    forged = value.replace(b"|3.250|", b"|999.000|")
    with pytest.raises(BadValue, match="authenticator"):
        decode_heartbeat(SECRET, KEY, forged)


@pytest.mark.parametrize(
    "value", [b"garbage", b"\xff\xfe\xfd", b"1|2|3", b"|" * 10, b"x" * 5000, b"7|120|backward|3.2|"]
)
def test_malformed_values_are_refused_never_raised_otherwise(value: bytes) -> None:
    with pytest.raises(BadValue):
        decode_heartbeat(SECRET, KEY, value)


@pytest.fixture
def accept_only() -> Iterator[tuple[str, int]]:
    """A listener that accepts connections and never answers: a store whose host is wedged."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()
    stop.set()
    thread.join(10)
    for connection in accepted:  # the stuck join's thread ends once its connection closes
        connection.close()
    listener.close()


@pytest.mark.timeout(120)
def test_joining_an_accept_only_listener_gives_up_within_the_bound(accept_only: tuple[str, int]) -> None:
    """TCPStore's own constructor waits for good against such a listener (its timeout is not a
    bound there); the link gives up at its bound and later calls fail at once."""
    link = StoreLink(lambda timeout_s: join_store(accept_only, timeout_s), name="test-store", timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not answer within 2 s"):
        link.connect(2.0)
    assert time.monotonic() - started < 60  # bounds a hang, generously
    with pytest.raises(StoreUnavailable, match="has not returned"):
        link.call("get", "anything")
    assert not link.close(0.1)  # the call still blocks its thread: close() says so, returns


class FailsOnce:
    """A real store whose first `set` after `arm()` raises what a reset connection raises."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._armed = False

    def arm(self) -> None:
        self._armed = True

    def set(self, key: str, value: str) -> None:
        if self._armed:
            self._armed = False
            raise ConnectionResetError(104, "Connection reset by peer")
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _monitor(store: Any, clock: Clock, reports: list[dict], world: int = 2) -> HangMonitor:
    keys = {rank: heartbeat_key("0123abcd", rank) for rank in range(world)}
    store.multi_set(list(keys.values()), [""] * world)
    link = StoreLink(None, name="test-monitor", timeout_s=5.0, store=store)
    judging = Judging(SECRET, PHASES, hang_after_s=10.0, interval_s=1.0, clock=clock)
    return HangMonitor(link, keys, judging, join_s=5.0, report=reports.append)


def _publisher(store: Any, rank: int, clock: Clock, tmp_path: Path) -> HeartbeatPublisher:
    link = StoreLink(None, name=f"test-heartbeat-{rank}", timeout_s=5.0, store=store)
    return HeartbeatPublisher(
        Heartbeat(),
        link,
        key=heartbeat_key("0123abcd", rank),
        secret=SECRET,
        rank=rank,
        run_id="once",
        hang_after_s=10.0,
        interval_s=1.0,
        dumps=DumpFiles(tmp_path, rank, flight_recorder=False),
        clock=clock,
    )


def test_one_failed_write_is_retried_and_the_rank_is_never_called_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A single ConnectionResetError once stopped a rank's heartbeat for good, and the monitor paged
    a hang every interval until close(): now the next interval publishes again."""
    store = FailsOnce(dist.HashStore())
    clock, reports = Clock(), []
    monitor = _monitor(store, clock, reports, world=1)
    publisher = _publisher(store, 0, clock, tmp_path)
    for second in range(60):
        clock.now = float(second)
        publisher.beat.step = second  # the rank moves every second
        if second == 20:
            store.arm()
        publisher.publish()
        monitor.check()
    assert reports == [] and monitor.hang is None
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == [
        "Telemetry: rank 0 could not publish its heartbeat (ConnectionResetError: [Errno 104] Connection "
        "reset by peer); it tries again every interval (a rank is called lost only once its heartbeat is "
        "stale)"
    ]


def test_values_refused_count_for_their_rank_alone_and_a_rank_never_heard_is_unwatched(
    tmp_path: Path,
) -> None:
    store = dist.HashStore()
    clock, reports = Clock(), []
    monitor = _monitor(store, clock, reports, world=3)
    publishers = [_publisher(store, rank, clock, tmp_path) for rank in (0, 1)]  # rank 2 never joined
    key = heartbeat_key("0123abcd", 1)
    for second in range(30):
        clock.now = float(second)
        for publisher in publishers:
            publisher.beat.step = second
            publisher.publish()
        if second == 8:
            store.set(key, b"1|0|forward|999.000|/etc/passwd|" + b"0" * 32)  # forged
        if second == 12:
            store.set(key, b"\x00garbage")  # malformed
        if second == 16:
            replay = store.get(key)
        if second == 18:
            store.set(key, replay)  # an older genuine value, written back
        monitor.check()
    assert monitor.ledger.rejected == 3 and monitor.hang is None
    assert [(r["train/hang/unwatched_ranks"], r["train/hang/rejected_values"]) for r in reports] == [
        (1.0, 0.0),
        (1.0, 1.0),
        (1.0, 2.0),
        (1.0, 3.0),
    ]
    assert all(report["train/hang/seconds"] == 0 for report in reports)


def test_a_rank_that_never_joined_is_unwatched_after_the_join_bound(tmp_path: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5)
    )
    clock, reports = Clock(), []
    monitor = _monitor(store, clock, reports, world=2)
    publisher = _publisher(store, 0, clock, tmp_path)
    for second in (0, 4, 5, 6):
        clock.now = float(second)
        publisher.beat.step = second
        publisher.publish()
        monitor.check()
    assert [report["train/hang/unwatched_ranks"] for report in reports] == [1.0]


def test_the_hosted_store_binds_the_interface_that_routes_to_the_rendezvous_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert interface_address() == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    address = ipaddress.ip_address(interface_address())  # an address, never a host name
    assert not address.is_unspecified
