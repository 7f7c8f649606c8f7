"""The scrape endpoint as a server: `name[]` filtering, bounded connections and idle time, a port in
use at start-up (in one process and on 2 gloo ranks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import torchtelemetry as tt
from tests.distributed import RankFailed, run_ranks
from tests.servers import http_get
from torchtelemetry.export import ExporterStartError, ExportHub, MetricDescriptor, RunInfo
from torchtelemetry.export._scrape_server import HANDLER_THREAD_PREFIX

LOSS, SEEN = MetricDescriptor("train/loss"), MetricDescriptor("seen")


def _families(body: bytes) -> set[str]:
    return {family.name for family in text_string_to_metric_families(body.decode())}


def _handler_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(HANDLER_THREAD_PREFIX)]


def test_name_filter_returns_the_named_families_only() -> None:
    exporter = tt.PrometheusExporter(port=0)
    hub = ExportHub([exporter], run=RunInfo(run_id="filter"))
    try:
        hub.describe([LOSS, SEEN])
        hub.submit(3, {"train/loss": 0.5, "seen": 2.0})
        assert hub.force_flush(10)
        base = exporter.url
        assert {"torchtelemetry_train_loss", "torchtelemetry_seen"} <= _families(http_get(base))
        filtered = http_get(f"{base}?name[]=torchtelemetry_train_loss&name[]=torchtelemetry_train_step")
        assert _families(filtered) == {"torchtelemetry_train_loss", "torchtelemetry_train_step"}
    finally:
        hub.close(10)


def test_connections_are_bounded_idle_ones_closed_and_none_left_after_close() -> None:
    exporter = tt.PrometheusExporter(port=0, max_connections=4, idle_timeout_s=10.0)
    exporter.describe([LOSS], RunInfo(run_id="bounded"))
    assert exporter.export(1, {"train/loss": 0.5}, time.time()).value == "success"
    # Never send. Connected without waiting for each handshake: past the listen backlog a blocking
    # connect waits for SYN retries, and on a busy host the first 4 could idle out meanwhile.
    held = [_connect_without_waiting(exporter.port) for _ in range(40)]
    try:
        deadline = time.monotonic() + 60
        while len(_handler_threads()) < 4 or exporter.refused_connections == 0:
            assert time.monotonic() < deadline, "the connections were never served nor refused"
            assert len(_handler_threads()) <= 4, "no more than max_connections handler threads"
            time.sleep(0.05)
        assert len(_handler_threads()) == 4, "the 4 served connections stay open until idle_timeout_s"
        for sock in held[:4]:  # the server closes what stays idle for idle_timeout_s
            sock.settimeout(30)
            assert sock.recv(1) == b""
        deadline = time.monotonic() + 30
        while True:  # with the slots free again, a real scrape is served
            try:
                body = http_get(exporter.url, timeout_s=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape served once idle connections were closed"
        assert b"torchtelemetry_train_loss" in body
        fresh = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(3)]
        exporter.close(10)
        assert _handler_threads() == [], "close() ends every open connection and joins its thread"
        for sock in fresh:
            sock.close()
    finally:
        for sock in held:
            sock.close()


def _connect_without_waiting(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))  # EINPROGRESS: the kernel completes the handshake
    return sock


def test_a_port_in_use_is_an_error_naming_the_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        exporter = tt.PrometheusExporter(port=port)
        with pytest.raises(
            ExporterStartError, match=rf"cannot serve on 127\.0\.0\.1 port {port} .*port {port}"
        ):
            tt.Telemetry({"loss": tt.WeightedMeanMetric()}, [exporter])


def _build_with_the_port_taken(rank: int, world_size: int, port: int) -> None:
    tt.Telemetry({"loss": tt.WeightedMeanMetric()}, [tt.PrometheusExporter(port=port)], timeout_s=30).close()


@pytest.mark.timeout(120)
def test_a_port_in_use_on_rank_zero_makes_every_rank_raise_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RankFailed) as failed:
            run_ranks(_build_with_the_port_taken, 2, port, timeout_s=90)
    errors = failed.value.errors
    assert errors[0].startswith("ExporterStartError") and f"port {port}" in errors[0]
    assert errors[1].startswith("TelemetryStartupError")
    assert (
        f"rank 0: ExporterStartError: PrometheusExporter 'prometheus': cannot serve on 127.0.0.1 port {port}"
        in (errors[1])
    )


def _trickle(sock: socket.socket, stop: threading.Event, every_s: float) -> None:
    """A slowloris: one byte of a request that never ends, every `every_s` (less than the idle
    timeout, so no single recv ever waits that long)."""
    with contextlib.suppress(OSError):
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        while not stop.wait(every_s):
            sock.sendall(b"X")


def test_clients_trickling_a_request_lose_their_slot_at_the_deadline_and_scrapes_are_served() -> None:
    idle_timeout_s = 2.0
    exporter = tt.PrometheusExporter(port=0, max_connections=4, idle_timeout_s=idle_timeout_s)
    exporter.describe([LOSS], RunInfo(run_id="slowloris"))
    assert exporter.export(1, {"train/loss": 0.5}, time.time()).value == "success"
    stop = threading.Event()
    held = [socket.create_connection(("127.0.0.1", exporter.port)) for _ in range(4)]
    tricklers = [
        threading.Thread(target=_trickle, args=(sock, stop, idle_timeout_s / 4), daemon=True) for sock in held
    ]
    try:
        for thread in tricklers:
            thread.start()
        deadline = time.monotonic() + 60
        while len(_handler_threads()) < 4:  # every slot is held by a trickler
            assert time.monotonic() < deadline, "the trickling connections were never served"
            time.sleep(0.05)
        served = None
        while served is None:  # the tricklers keep trickling for as long as this takes
            try:
                served = http_get(exporter.url, timeout_s=5)
            except OSError:
                assert time.monotonic() < deadline, "no scrape served while clients trickle requests"
                time.sleep(0.2)
        assert b"torchtelemetry_train_loss" in served
        for sock in held:  # the server closed each trickler, whatever it kept sending
            sock.settimeout(30)
            assert sock.recv(1) == b""
    finally:
        stop.set()
        exporter.close(10)
        for sock in held:
            sock.close()
    assert _handler_threads() == []
