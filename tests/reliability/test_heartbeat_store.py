"""The hang heartbeat's store in real process groups: only the job can write it, and it closes with
the run.

A second process (this test) that reaches the store writes forged, malformed and replayed
heartbeats: each is refused and counted, never trusted, and the monitor goes on naming a real hang.
The store a rank hosts listens on the process group's interface only and is gone when `close()`
returns (five `Telemetry` in one process leave no port); on a `tcp://` rendezvous the job's own store
carries the heartbeats and nothing new listens. A rank whose store answers nothing (an accept-only
listener in its place) gives up within `timeout_s` with one warning, trains on, and the exporting
rank reports it unwatched. Every wait is bounded and waits on what the run reported.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.run._store import interface_address

HANG_AFTER_S = 3.0
INTERVAL_S = 0.2
DEADLINE_S = 120.0


def _listening() -> set[tuple[str, int]]:
    """The TCP sockets this process listens on: (address in /proc's hex, port)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.split(":")
                found.add((address, int(port, 16)))
    return found


def _refused(address: tuple[str, int]) -> bool:
    with socket.socket() as probe:
        probe.settimeout(5)
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            return True
    return False


def _five_in_a_row(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    before = _listening()
    addresses = []
    for _ in range(5):
        telemetry = tt.Telemetry({"loss": tt.SumMetric()}, hang_after_s=HANG_AFTER_S, dump_dir=directory)
        addresses.append(telemetry._hang_watch.address)
        listening = _listening() - before
        telemetry.close()
    return {
        "threads": sorted(
            thread.name
            for thread in threading.enumerate()
            if thread.name.startswith(("torchtelemetry-heartbeat", "torchtelemetry-hang"))
        ),
        "left_listening": sorted(_listening() - before),
        "listening_while_open": sorted(listening),
        "addresses": addresses,
        "refused": [_refused(tuple(address)) for address in addresses],
    }


@pytest.mark.timeout(300)
def test_the_store_listens_on_the_groups_interface_and_closes_with_each_telemetry(tmp_path: Path) -> None:
    """Five Telemetry built and closed in one process used to leave five open, accepting ports; now
    neither a port nor a thread of hang detection outlives `close()`."""
    exporting, other = run_ranks(_five_in_a_row, 2, str(tmp_path), timeout_s=240)
    assert exporting["left_listening"] == [] and other["left_listening"] == []
    assert exporting["threads"] == [] and other["threads"] == []  # every heartbeat thread ended
    hosts = {host for host, _ in exporting["addresses"]}
    assert len(set(map(tuple, exporting["addresses"]))) == 5 and hosts == {"127.0.0.1"}
    assert exporting["refused"] == [True] * 5
    # While open, the store listens on 127.0.0.1 (hex, little-endian) alone, never on every interface.
    port = exporting["addresses"][-1][1]
    assert [host for host, bound in exporting["listening_while_open"] if bound == port] == ["0100007F"]


def _stages(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Two pipeline stages, [0, 1] and [2, 3], each with its own Telemetry: rank 2 exports its stage
    though it is not global rank 0, and hosts that stage's store."""
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    telemetry = tt.Telemetry(
        {"loss": tt.SumMetric()}, group=stages[rank // 2], heartbeat_interval_s=INTERVAL_S, dump_dir=directory
    )
    monitor = telemetry._hang_watch.monitor
    if monitor is not None:  # the other rank of the stage joined: the monitor hears it
        _wait_for("the stage's other rank", lambda: len(monitor.ledger.beats(time.monotonic())) == 2)
    address = telemetry._hang_watch.address
    telemetry.close()
    return {"address": list(address), "exporting": monitor is not None}


@pytest.mark.timeout(300)
def test_an_exporting_rank_that_is_not_global_rank_0_advertises_its_interface_address(tmp_path: Path) -> None:
    """It used to advertise `socket.gethostname()`, which often resolves to 127.0.1.1 (or another
    host's view of it); now the address of the interface the process group uses, as bound."""
    results = run_ranks(_stages, 4, str(tmp_path), timeout_s=240)
    assert [result["exporting"] for result in results] == [True, False, True, False]
    assert results[0]["address"] == results[1]["address"] and results[2]["address"] == results[3]["address"]
    host, port = results[2]["address"]
    assert ipaddress.ip_address(host) == ipaddress.ip_address(interface_address())
    assert port != results[0]["address"][1]


def _on_the_job_store(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    job = dist.distributed_c10d._get_default_store()
    while isinstance(job, dist.PrefixStore):
        job = job.underlying_store
    listening = []
    for hang_after_s in (None, HANG_AFTER_S):  # what listens without hang detection, and with it
        before = _listening()
        telemetry = tt.Telemetry(
            {"loss": tt.SumMetric()},
            [tt.JsonlExporter(Path(directory) / "metrics.jsonl")],
            every=1_000_000,
            hang_after_s=hang_after_s,
            heartbeat_interval_s=INTERVAL_S,
            dump_dir=directory,
        )
        listening.append(len(_listening() - before))
        if hang_after_s is None:
            telemetry.close()
    while not (Path(directory) / "released").exists():
        with telemetry.phase("forward"):  # rank 0 moves on; rank 1 is stuck until rank 0 saw it
            if rank == 1:
                _wait_for_file(Path(directory) / "released")
            elif _reports(Path(directory), lambda r: r.get("train/hang/seconds", 0) > 0):
                (Path(directory) / "released").touch()
            time.sleep(0.05)
    address = telemetry._hang_watch.address
    telemetry.close()
    return {"job": [job.host, job.port], "heartbeat": list(address), "listening": listening}


@pytest.mark.timeout(300)
def test_a_tcp_rendezvous_lends_its_own_store_and_nothing_new_listens(tmp_path: Path) -> None:
    results = run_ranks(_on_the_job_store, 2, str(tmp_path), rendezvous="tcp", timeout_s=240)
    for result in results:
        assert result["heartbeat"] == result["job"]
        without, with_hangs = result["listening"]  # gloo's own groups listen; hang detection adds none
        assert with_hangs == without
    (hung,) = _reports(tmp_path, lambda r: r.get("train/hang/seconds", 0) > 0)[:1]
    assert (hung["train/hang/rank"], hung["train/hang/phase"]) == (1, {"forward": 1.0})


def _attacked(rank: int, world_size: int, directory: str) -> None:
    """Three ranks, each entering phases on its own; rank 0 tells the test the store's address, rank
    2 its key.
    Once told (`stick`), rank 1 gets stuck in forward until `released`."""
    path = Path(directory)
    telemetry = tt.Telemetry(
        {"loss": tt.SumMetric()},
        [tt.JsonlExporter(path / "metrics.jsonl")],
        every=1_000_000,
        run_id="attacked",
        hang_after_s=HANG_AFTER_S,
        heartbeat_interval_s=INTERVAL_S,
        dump_dir=directory,
    )
    if rank == 2:
        (path / "key.partial").write_text(json.dumps(telemetry._hang_watch.publisher.key))
        (path / "key.partial").rename(path / "key")
    if rank == 0:
        (path / "store.partial").write_text(json.dumps(telemetry._hang_watch.address))
        (path / "store.partial").rename(path / "store")
    while not (path / "released").exists():  # each phase entered is progress (no step: no window)
        with telemetry.phase("forward"):
            if rank == 1 and (path / "stick").exists():
                _wait_for_file(path / "released")
            time.sleep(0.01)
    telemetry.close()


@pytest.mark.timeout(300)
def test_forged_malformed_and_replayed_heartbeats_are_refused_and_a_real_hang_is_still_named(
    tmp_path: Path,
) -> None:
    """Anyone who reaches the store could page RankHung (`seconds=999`), clear a real hang, or stop
    the monitor with one malformed value. Now each bad value is refused for its rank alone and
    counted (`train/hang/rejected_values`), and the monitor goes on to name the real hang."""
    failures: list[BaseException] = []

    def ranks() -> None:
        try:
            run_ranks(_attacked, 3, str(tmp_path), timeout_s=240)
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=ranks)
    thread.start()
    try:
        _wait_for("the store's address", (tmp_path / "store").exists)
        _wait_for("rank 2's key", (tmp_path / "key").exists)
        host, port = json.loads((tmp_path / "store").read_text())
        key = json.loads((tmp_path / "key").read_text())
        store = dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
        )
        replayed = store.get(key)
        _wait_for("a newer heartbeat", lambda: store.get(key) != replayed)
        forged = b"999999|0|forward|999.000|/etc/passwd|" + b"0" * 32
        for count, value in enumerate((forged, b"\xff|garbage", replayed), 1):
            _attack_until_counted(store, key, value, tmp_path, count)
        (tmp_path / "stick").touch()
        hung = _wait_for(
            "the real hang",
            lambda: _reports(tmp_path, lambda r: r.get("train/hang/seconds", 0) > HANG_AFTER_S),
        )[0]
        assert (hung["train/hang/rank"], hung["train/hang/phase"]) == (1, {"forward": 1.0})
    finally:
        (tmp_path / "released").touch()
        thread.join(240)
    assert not failures, failures
    reports = _reports(tmp_path, lambda r: "train/hang/seconds" in r)
    assert not [r for r in reports if r["train/hang/seconds"] >= 999 or "/etc/passwd" in r["train/hang/dump"]]
    assert max(r["train/hang/rejected_values"] for r in reports) >= 3


def _attack_until_counted(store: Any, key: str, value: bytes, directory: Path, count: int) -> None:
    """Write `value` under `key` until the monitor reported `count` values refused: once, and again
    when the rank overwrote it before the monitor read it (the rank's own values keep coming)."""
    deadline = time.monotonic() + DEADLINE_S
    while not _reports(directory, lambda r: r.get("train/hang/rejected_values", 0) >= count):
        assert time.monotonic() < deadline, f"value {count} was never counted as refused"
        store.set(key, value)
        time.sleep(3 * INTERVAL_S)


def _unwatched(rank: int, world_size: int, directory: str) -> list[str]:
    """Rank 1 finds an accept-only listener in place of the store: it gives up within timeout_s."""
    path = Path(directory)
    records: list[str] = []
    if rank == 1:
        listener = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
        import torchtelemetry.run._watch as watch

        join = watch.join_store
        watch.join_store = lambda address, timeout_s: join(listener.getsockname(), timeout_s)
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("torchtelemetry").addHandler(handler)
    started = time.monotonic()
    telemetry = tt.Telemetry(
        {"loss": tt.SumMetric()},
        [tt.JsonlExporter(path / "metrics.jsonl")],
        every=2,
        hang_after_s=HANG_AFTER_S,
        heartbeat_interval_s=INTERVAL_S,
        timeout_s=3.0,
        dump_dir=directory,
    )
    built_s = time.monotonic() - started
    for step in range(4):  # training goes on: windows collected with the rank that has no heartbeat
        telemetry.metrics["loss"].update(torch.tensor(1.0))
        telemetry.step(step)
    telemetry.flush()
    if rank == 0:
        _wait_for(
            "the unwatched rank", lambda: _reports(path, lambda r: r.get("train/hang/unwatched_ranks") == 1)
        )
        (path / "reported").touch()
    else:
        _wait_for_file(path / "reported")
        assert built_s < 60, built_s  # bounds a hang, generously (timeout_s is 3 s)
    telemetry.close()
    return records


@pytest.mark.timeout(300)
def test_a_rank_that_cannot_join_gives_up_within_timeout_s_trains_on_and_is_reported_unwatched(
    tmp_path: Path,
) -> None:
    _, warnings = run_ranks(_unwatched, 2, str(tmp_path), timeout_s=240)
    (warning,) = warnings
    assert warning.startswith("Telemetry: rank 1 could not join the heartbeat store at 127.0.0.1:")
    assert "hang detection is off on this rank (the exporting rank reports it unwatched)" in warning
    windows = _reports(tmp_path, lambda r: "loss" in r)
    assert [window["loss"] for window in windows][:2] == [4.0, 4.0]  # both ranks, two steps each


def _reports(directory: Path, accept: Callable[[dict], bool]) -> list[dict]:
    path = directory / "metrics.jsonl"
    if not path.exists():
        return []
    reports = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line being written
            values = json.loads(line)["values"]
            if accept(values):
                reports.append(values)
    return reports


def _wait_for(what: str, found: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := found()):
        assert time.monotonic() < deadline, f"no {what} within {DEADLINE_S:.0f} s"
        time.sleep(0.05)
    return value


def _wait_for_file(path: Path) -> None:
    _wait_for(str(path), path.exists)
