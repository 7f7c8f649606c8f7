"""Run a function on N real gloo ranks in their own processes, with a timeout so a hang fails.

The ranks are forked from a forkserver that imported torch and torchtelemetry once (per test
process), not spawned: a spawned rank spends about 2 s of CPU importing torch again, and the suite
starts several hundred ranks. Each rank is still a separate process with its own gloo group; it
gets the test's environment as it is when the ranks start (`os.environ` then, plus `env`).
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import shutil
import signal
import socket
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _first_ephemeral_port() -> int:
    """The lowest local port the kernel gives outgoing connections and port-0 binds."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server the test starts later. Picked below the ephemeral
    range where there is room, so no outgoing connection (a scrape, gloo) or port-0 server takes it
    in the meantime (a port the kernel gave out for port 0 was taken so once as a 2-rank run started)."""
    first = _first_ephemeral_port()
    for _ in range(200 if first > 10000 else 0):
        port = random.randint(10000, first - 1)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_PRELOADED = ["torch", "torch.distributed", "torchtelemetry", "pytest", "tests.distributed"]
"""Imported once by the forkserver, before it forks any rank."""


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    results: Any,
    args: tuple,
    env: dict[str, str],
    pg_timeout_s: float,
) -> None:
    os.environ.clear()  # the forkserver's environment is the one it started with, not the test's
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException as error:
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def nccl_world_of_one() -> Iterator[None]:
    """This process as the only rank of a default NCCL process group on its current CUDA device."""
    import torch

    with tempfile.TemporaryDirectory(prefix="torchtelemetry-rdzv-") as rendezvous:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{os.path.join(rendezvous, 'store')}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


class RankFailed(RuntimeError):
    """At least one rank raised; `errors` maps rank -> formatted exception."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__("\n".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items())))
        self.errors = errors


def _rank_processes(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    env: dict[str, str] | None,
    pg_timeout_s: float,
    rendezvous: str = "file",
) -> tuple[list[Any], Any, str]:
    """One (not yet started) process per rank, the queue they report to, and the directory of their
    file rendezvous (no port, so concurrent test runs never race for one). `rendezvous="tcp"`: a
    TCPStore hosted by rank 0 on 127.0.0.1 instead (`tcp://`, as `MASTER_ADDR:MASTER_PORT` gives)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOADED)  # read when this process's forkserver starts
    results = ctx.Queue()
    rendezvous_dir = tempfile.mkdtemp(prefix="torchtelemetry-rdzv-")
    init_method = (
        f"tcp://127.0.0.1:{free_port()}"
        if rendezvous == "tcp"
        else f"file://{os.path.join(rendezvous_dir, 'store')}"
    )
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                fn,
                rank,
                world_size,
                init_method,
                results,
                args,
                {**os.environ, **(env or {})},
                pg_timeout_s,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    return procs, results, rendezvous_dir


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    victim: int | None = None,
    rendezvous: str = "file",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    `fn` must be importable (module level). Raises `RankFailed` if a rank raised,
    `TimeoutError` (after killing every rank) if the ranks did not finish in time.
    Rank `victim`, if given, must die by SIGKILL without reporting; its result is None.
    `rendezvous`: "file" (default) or "tcp" (`_rank_processes`).
    """
    procs, results, rendezvous_dir = _rank_processes(fn, world_size, args, env, pg_timeout_s, rendezvous)
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    expected = world_size if victim is None else world_size - 1
    try:
        while len(outcomes) < expected:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish in {timeout_s}s"
                ) from None
            outcomes[rank] = (ok, value)
        if victim is not None:
            procs[victim].join(timeout=timeout_s)
            if procs[victim].exitcode != -signal.SIGKILL:
                raise AssertionError(f"rank {victim} ended with {procs[victim].exitcode}, expected SIGKILL")
            outcomes[victim] = (True, None)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
    errors = {rank: value for rank, (ok, value) in outcomes.items() if not ok}
    if errors:
        raise RankFailed(errors)
    return [outcomes[rank][1] for rank in range(world_size)]


@contextmanager
def started_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    pg_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> Iterator[list[Any]]:
    """Start `fn(rank, world_size, *args)` on `world_size` gloo ranks and yield their processes
    without waiting for them (ranks that hang on purpose); every one is killed on leaving."""
    procs, _, rendezvous_dir = _rank_processes(fn, world_size, args, env, pg_timeout_s)
    try:
        for proc in procs:
            proc.start()
        yield procs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=30)
        shutil.rmtree(rendezvous_dir, ignore_errors=True)
