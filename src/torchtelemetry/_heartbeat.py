"""The heartbeat: each rank publishes where its training thread is; a stuck rank dumps its stacks.

The training thread writes a `Heartbeat` (its step, its collection waits) with plain assignments, and
the heartbeat reads the phase it is in from the phase timers' own state. A daemon
thread per rank (`torchtelemetry-heartbeat`) reads it every `heartbeat_interval_s`, notes when it
last changed (progress), and sets it in a `torch.distributed.TCPStore` hosted by the exporting rank,
whose address the ranks agree on at start-up, on the start-up group: no server of our own, and
nothing on the training's process groups. A rank that finds itself without progress for
`hang_after_s` writes its Python stacks (every thread, `faulthandler`) to `dump_dir`, once per hang,
and on NCCL with the flight recorder enabled its flight-recorder trace too; the exporting rank's
`HangMonitor` reads every heartbeat and exports the hang (`_hang_monitor`).
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtelemetry._hang_monitor import HangMonitor, encode_heartbeat, heartbeat_key
from torchtelemetry._run_parts import RunParts
from torchtelemetry._startup import EveryRank
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.report import Heartbeat
from torchtelemetry.sync import group_rank, group_world_size, resolve_group

__all__ = ["HangWatch", "HeartbeatPublisher", "dump_stacks", "watch_hangs"]

logger = logging.getLogger(__name__)


def dump_stacks(
    directory: Path, run_id: str, rank: int, step: int, phase: str, stalled_s: float, backend: str | None
) -> str:
    """Write this process's Python stacks (every thread) to `directory`, named with the run, rank and
    step; on NCCL with the flight recorder on (`TORCH_NCCL_TRACE_BUFFER_SIZE` > 0), its trace beside
    them. Returns the stack file's path."""
    name = f"torchtelemetry-hang-{re.sub(r'[^A-Za-z0-9_.-]', '_', run_id)}-rank{rank}-step{step}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.txt"
    with open(path, "w") as file:
        file.write(
            f"torchtelemetry: run {run_id} rank {rank} made no progress for {stalled_s:.0f} s, at step "
            f"{step} in phase {phase!r}; Python stacks of every thread (most recent call first):\n\n"
        )
        file.flush()
        faulthandler.dump_traceback(file, all_threads=True)
    if backend == "nccl" and int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) > 0:
        try:  # torch's flight recorder (private API): untestable without NCCL, so guarded and logged
            from torch._C._distributed_c10d import _dump_nccl_trace

            (directory / f"{name}-flight-recorder.pkl").write_bytes(_dump_nccl_trace())
        except Exception as error:
            logger.warning("Telemetry: could not dump NCCL's flight recorder: %s", error)
    return str(path)


class HeartbeatPublisher:
    """Publishes one rank's `Heartbeat` to `store` every `interval_s` on a daemon thread, and dumps
    the rank's stacks once per hang (`dump_stacks`) when it made no progress for `hang_after_s`."""

    def __init__(
        self,
        beat: Heartbeat,
        store: Any,
        *,
        rank: int,
        run_id: str,
        hang_after_s: float,
        interval_s: float,
        dump_dir: Path,
        backend: str | None,
    ) -> None:
        self.beat = beat
        self._store = store
        self._key = heartbeat_key(rank)
        self._rank = rank
        self._run_id = run_id
        self._hang_after_s = hang_after_s
        self._interval_s = interval_s
        self._dump_dir = dump_dir
        self._backend = backend
        self._where = beat.where()
        self._since = time.monotonic()
        self._published = 0
        self.dump = ""
        """The stack file of the current hang (empty while the rank makes progress)."""
        self.published: tuple[int, str, int] | None = None
        """The `Heartbeat.where()` last set in the store."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchtelemetry-heartbeat", daemon=True)

    def start(self) -> HeartbeatPublisher:
        self.publish()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.publish()

    def publish(self) -> None:
        """Note progress, dump the stacks if the rank is stuck, and set the heartbeat in the store."""
        where, now = self.beat.where(), time.monotonic()
        if where != self._where:
            self._where, self._since, self.dump = where, now, ""
        stalled_s = now - self._since
        step, phase, _ = where
        if stalled_s >= self._hang_after_s and not self.dump:
            try:
                self.dump = dump_stacks(
                    self._dump_dir, self._run_id, self._rank, step, phase, stalled_s, self._backend
                )
                logger.error(
                    "Telemetry: rank %d made no progress for %.0f s (step %d, phase %r); stacks in %s",
                    self._rank,
                    stalled_s,
                    step,
                    phase,
                    self.dump,
                )
            except OSError as error:
                self.dump = f"(not written: {error})"
                logger.error("Telemetry: rank %d could not write its stacks: %s", self._rank, error)
        self._published += 1
        payload = encode_heartbeat(self._published, step, phase, stalled_s, self.dump)
        try:
            self._store.set(self._key, payload)
            self.published = where
        except Exception as error:  # the store's host is gone (closed, or died): nobody reads any more
            self._stop.set()
            logger.warning(
                "Telemetry: rank %d could not publish its heartbeat (%s); it stops publishing: the "
                "exporting rank closed its telemetry or died, so no hang can be reported from here on",
                self._rank,
                error,
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop publishing (bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


@dataclass(slots=True)
class HangWatch:
    """One rank's heartbeat, its publisher, and on the exporting rank the store and the monitor."""

    beat: Heartbeat
    publisher: HeartbeatPublisher | None
    monitor: HangMonitor | None
    store: Any

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the monitor and the publisher, both within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for thread in (self.monitor, self.publisher):
            if thread is not None:
                thread.close(max(0.0, deadline - time.monotonic()))


def watch_hangs(config: TelemetryConfig, parts: RunParts, every_rank: EveryRank) -> HangWatch | None:
    """Start one rank's heartbeat (None with `hang_after_s=None`). Collective over the start-up group:
    the exporting rank hosts the store and every rank learns its address. A store that cannot be
    hosted or reached turns hang detection off on that rank with an error logged, never a failure."""
    if config.hang_after_s is None:
        return None
    group = resolve_group(config.group, op="Telemetry")
    rank, world_size = group_rank(group), group_world_size(group)
    beat = Heartbeat()
    server = _host_store(world_size, config.timeout_s) if parts.is_exporting else None
    store = server
    if dist.is_available() and dist.is_initialized() and group is not None:
        address = None if server is None else (_store_host(), server.port)
        addresses = every_rank.all_gather_object(address, "Telemetry (heartbeat store)")
        address = addresses[dist.get_global_rank(group, 0)]
        if store is None and address is not None:
            store = _join_store(address, config.timeout_s, rank)
    if store is None:
        logger.error(
            "Telemetry: rank %d has no heartbeat store (see the errors above); hangs are not detected", rank
        )
        return HangWatch(beat, None, None, None)
    if parts.signals is not None:
        parts.signals.record_into(beat)
    backend = dist.get_backend(group) if group is not None else None
    dump_dir = Path(config.dump_dir) if config.dump_dir is not None else Path.cwd()
    publisher = HeartbeatPublisher(
        beat,
        store,
        rank=rank,
        run_id=parts.run.run_id,
        hang_after_s=config.hang_after_s,
        interval_s=config.heartbeat_interval_s,
        dump_dir=dump_dir,
        backend=backend,
    ).start()
    monitor = None
    if parts.is_exporting:
        monitor = HangMonitor(
            store,
            world_size,
            phases=config.phases,
            hang_after_s=config.hang_after_s,
            interval_s=config.heartbeat_interval_s,
            submit=parts.hub.submit,
            latest_step=lambda: parts.publisher.latest_step,
        ).start()
    return HangWatch(beat, publisher, monitor, server)


def _host_store(world_size: int, timeout_s: float) -> Any:
    """The exporting rank's store, every rank's key set empty (so one `multi_get` never waits)."""
    try:
        if not (dist.is_available() and dist.is_initialized()):
            store: Any = dist.HashStore()
        else:
            store = dist.TCPStore(
                "0.0.0.0",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        store.multi_set([heartbeat_key(rank) for rank in range(world_size)], [""] * world_size)
        return store
    except Exception as error:
        logger.error("Telemetry: could not host the heartbeat store: %s", error)
        return None


def _join_store(address: tuple[str, int], timeout_s: float, rank: int) -> Any:
    host, port = address
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as error:
        logger.error(
            "Telemetry: rank %d could not reach the heartbeat store at %s:%d: %s", rank, host, port, error
        )
        return None


def _store_host() -> str:
    """How the other ranks reach this host: `MASTER_ADDR` on global rank 0 (the launcher's
    rendezvous host), the host name elsewhere."""
    master = os.environ.get("MASTER_ADDR")
    if master and dist.is_available() and dist.is_initialized() and dist.get_rank() == 0:
        return master
    return socket.gethostname()
