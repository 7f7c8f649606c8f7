"""The demo's launcher: spawn `nproc` ranks (or run as one torchrun rank), forward Ctrl-C, clean up."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchtelemetry.demo._config import DemoConfig
from torchtelemetry.demo._console import INTERRUPTED_EXIT_CODE
from torchtelemetry.demo._loop import train

__all__ = ["run"]


def _device_for(config: DemoConfig, local_rank: int) -> torch.device:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # Ranks share the host's cores: one intra-op pool each would oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu")


def _rank_main(local_rank: int, config: DemoConfig, world_size: int, port: int | None) -> int:
    if port is not None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), WORLD_SIZE=str(world_size)
        )
        os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    device = _device_for(config, local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120)
    )
    try:
        return train(config, dist.get_rank(), dist.get_world_size(), device)
    finally:
        dist.destroy_process_group()


def _spawned_rank(local_rank: int, config: DemoConfig, world_size: int, port: int) -> None:
    # Exit 0 after a Ctrl-C too: a non-zero exit would make the launcher kill ranks still flushing.
    _rank_main(local_rank, config, world_size, port)


def run(config: DemoConfig) -> int:
    """Run the demo: under torchrun as this rank, else by spawning `config.nproc` ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(int(os.environ.get("LOCAL_RANK", "0")), config, int(os.environ["WORLD_SIZE"]), None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(
        _spawned_rank,
        args=(config, config.nproc, port),
        nprocs=config.nproc,
        join=False,
        start_method="spawn",
    )
    interrupted: list[int] = []

    def forward_interrupt(signum: int, frame: Any) -> None:
        """Pass Ctrl-C to every rank (they may not share the terminal, e.g. under a test harness)."""
        interrupted.append(signum)
        for process in context.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward_interrupt)
    try:
        finished = False
        while not finished:  # join() returns False while some rank is still running
            finished = context.join()
    except mp.ProcessExitedException as error:
        print(f"torchtelemetry demo: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return INTERRUPTED_EXIT_CODE if interrupted else 0
