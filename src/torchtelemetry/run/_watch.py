"""Starting and closing hang detection for one rank (`watch_hangs`, `HangWatch`).

Start-up, collective over the start-up group: the exporting rank opens the store (the job's own
TCP rendezvous store, else one it hosts on the process group's interface and `heartbeat_port`; a
dict in memory for a group of one), draws a secret and a token, and every rank learns them from one
gather; each other rank then joins the store within `timeout_s`, or turns hang detection off on
itself with one warning (the exporting rank reports it unwatched) and trains on. Every rank
publishes its heartbeat; the exporting rank monitors every rank; the next rank watches the
exporting rank. `close()` stops them all and releases the store (a hosted store's port closes).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtelemetry._startup import EveryRank
from torchtelemetry.config import TelemetryConfig
from torchtelemetry.export import Exporter, RunInfo
from torchtelemetry.report import ReportValues
from torchtelemetry.run._deputy_route import DeputyRoute
from torchtelemetry.run._dumps import DumpFiles, HangCaptures, dump_directory, flight_recorder_on
from torchtelemetry.run._heartbeat import Heartbeat, HeartbeatPublisher, SectionTimer
from torchtelemetry.run._monitor import Deputy, HangMonitor, Judging
from torchtelemetry.run._store import (
    StoreLink,
    StoreUnavailable,
    heartbeat_key,
    host_store,
    interface_address,
    job_store_address,
    join_store,
)
from torchtelemetry.sync import GroupLike, group_rank, group_world_size, resolve_group

__all__ = ["HangSettings", "HangWatch", "watch_hangs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HangSettings:
    """What hang detection takes from `TelemetryConfig` (each field's docs there)."""

    hang_after_s: float
    interval_s: float
    timeout_s: float
    """Bound on opening and joining the store at start-up."""
    port: int
    dump_dir: Path
    phases: tuple[str, ...]

    @classmethod
    def of(cls, config: TelemetryConfig) -> HangSettings | None:
        """The settings of `config`; None with `hang_after_s=None` (no heartbeat)."""
        if config.hang_after_s is None:
            return None
        return cls(
            hang_after_s=config.hang_after_s,
            interval_s=config.heartbeat_interval_s,
            timeout_s=config.timeout_s,
            port=config.heartbeat_port,
            dump_dir=dump_directory(config.dump_dir),
            phases=tuple(config.phases),
        )


@dataclass(frozen=True, slots=True)
class _Offer:
    """What the exporting rank tells every rank at start-up."""

    address: tuple[str, int] | None
    """The store's host and port (None: in the exporting rank's memory, a group of one)."""
    token: str
    secret: bytes


@dataclass(slots=True)
class _Links:
    """A rank's connections to the store: its publisher's, and its watcher's (the exporting rank's
    and the next rank's)."""

    publishing: StoreLink
    watching: StoreLink | None

    @classmethod
    def to(cls, offer: _Offer, settings: HangSettings, *, watching: bool, hosted: Any = None) -> _Links:
        """Links to the store of `offer` (`hosted`: the store itself, in this process)."""
        address = offer.address

        def link(name: str) -> StoreLink:
            if hosted is not None or address is None:
                return StoreLink(None, name=name, timeout_s=2 * settings.interval_s, store=hosted)
            return StoreLink(
                lambda timeout_s: join_store(address, timeout_s), name=name, timeout_s=2 * settings.interval_s
            )

        watcher = link("torchtelemetry-hang-store") if watching else None
        return cls(link("torchtelemetry-heartbeat-store"), watcher)

    def close(self, timeout_s: float) -> bool:
        """Close them (dropping the store); False when a call still blocks one after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        links = [link for link in (self.publishing, self.watching) if link is not None]
        return all([link.close(max(0.0, deadline - time.monotonic())) for link in links])


class HangWatch:
    """One rank's heartbeat publisher, and the exporting rank's monitor or the next rank's deputy."""

    def __init__(
        self,
        publisher: HeartbeatPublisher,
        watcher: HangMonitor | Deputy | None,
        route: DeputyRoute | None,
        links: _Links,
        address: tuple[str, int] | None,
    ) -> None:
        self.address = address
        """The heartbeat store's host and port (None: in the exporting rank's memory, a group of one)."""
        self.publisher = publisher
        self.watcher = watcher
        self._route = route
        self._links = links

    @property
    def monitor(self) -> HangMonitor | None:
        """The exporting rank's monitor (None elsewhere)."""
        return self.watcher if isinstance(self.watcher, HangMonitor) else None

    def adopt_run(self, run: RunInfo) -> None:
        """Name stack files (and the deputy's reports) with `run`'s id from now on."""
        self.publisher.run_id = run.run_id
        if self._route is not None:
            self._route.run = run

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish one last heartbeat (closed), let the watcher look a last time (a hang that just
        cleared is reported cleared), stop every thread and release the store, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        self.publisher.close(timeout_s)
        if self.watcher is not None:
            self.watcher.close(max(0.0, deadline - time.monotonic()))
        if self._route is not None:
            self._route.close(max(0.0, deadline - time.monotonic()))
        if not self._links.close(max(0.0, deadline - time.monotonic())):
            logger.warning(
                "Telemetry: a call to the heartbeat store has not returned (its host stopped "
                "answering); its thread ends when the call does"
            )


def watch_hangs(
    settings: HangSettings | None,
    every_rank: EveryRank,
    *,
    timers: Sequence[SectionTimer],
    group: GroupLike,
    exporting: bool,
    run: RunInfo,
    submit: Callable[[int, ReportValues], None],
    latest_step: Callable[[], int | None],
    exporters: Sequence[Exporter],
    captures: HangCaptures | None = None,
) -> HangWatch | None:
    """Start this rank's heartbeat (its phases and data wait read from `timers`), publisher and
    watcher (collective over the start-up group, see the module); None without `settings`
    (`hang_after_s=None`) or a store (one warning). The exporting rank's monitor exports through
    `submit` at `latest_step()`; the next rank reports through its `DeputyRoute` over `exporters`.
    A stuck rank's stacks go to a hang capture directory while `captures` allows (docs/signals.md,
    Captures). The façade hands the heartbeat (`HangWatch.publisher.beat`) to its one writer."""
    if settings is None:
        return None
    resolved = resolve_group(group, op="Telemetry")
    rank, world_size = group_rank(resolved), group_world_size(resolved)
    opened = _open(world_size, settings) if exporting else None
    offer = opened[0] if opened is not None else None
    if dist.is_available() and dist.is_initialized() and resolved is not None:
        offers = every_rank.all_gather_object(offer, "Telemetry (heartbeat store)")
        offer = offers[dist.get_global_rank(resolved, 0)]
    if not isinstance(offer, _Offer):
        logger.warning("Telemetry: rank %d has no heartbeat store (see above); hangs are not detected", rank)
        return None
    links = opened[1] if opened is not None else _joined(offer, settings, rank, watching=rank == 1)
    if links is None:
        return None
    backend = dist.get_backend(resolved) if resolved is not None else None
    dumps = DumpFiles(settings.dump_dir, rank, flight_recorder=flight_recorder_on(backend), captures=captures)
    judging = Judging(offer.secret, settings.phases, settings.hang_after_s, settings.interval_s)
    publisher = HeartbeatPublisher(
        Heartbeat(timers),
        links.publishing,
        key=heartbeat_key(offer.token, rank),
        secret=offer.secret,
        rank=rank,
        run_id=run.run_id,
        hang_after_s=settings.hang_after_s,
        interval_s=settings.interval_s,
        dumps=dumps,
    ).start()
    watcher: HangMonitor | Deputy | None = None
    route = None
    if links.watching is not None and exporting:
        keys = {other: heartbeat_key(offer.token, other) for other in range(world_size)}

        def report(values: ReportValues) -> None:
            submit(latest_step() or 0, values)

        joined_s = settings.timeout_s + 2 * settings.interval_s
        watcher = HangMonitor(links.watching, keys, judging, join_s=joined_s, report=report).start()
    elif links.watching is not None:
        route = DeputyRoute(exporters, run, rank)

        def push(values: ReportValues) -> None:
            route.submit(latest_step() or 0, values)

        leader = heartbeat_key(offer.token, 0)
        watcher = Deputy(
            links.watching, 0, leader, judging, publisher=publisher, dumps=dumps, report=push
        ).start()
    return HangWatch(publisher, watcher, route, links, offer.address)


def _open(world_size: int, settings: HangSettings) -> tuple[_Offer, _Links] | None:
    """The exporting rank's store with every rank's key set empty (so that one `multi_get` never
    waits for a key), and the offer to the other ranks; None when it cannot be opened (logged)."""
    token, secret = secrets.token_hex(8), secrets.token_bytes(32)
    address: tuple[str, int] | None = None
    hosted: Any = None
    links = None
    try:
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            hosted = dist.HashStore()
        elif (address := job_store_address()) is None:
            host = interface_address()
            hosted, port = host_store(host, settings.port, settings.timeout_s)
            address = (host, port)
        offer = _Offer(address, token, secret)
        links = _Links.to(offer, settings, watching=True, hosted=hosted)
        whose = "hosted by this rank" if hosted is not None else "the job's rendezvous store"
        logger.info("Telemetry: the hang heartbeat store is %s, at %s", whose, address or "(in memory)")
        del hosted  # the links hold it: closing them releases it (and a hosted store's port)
        keys = [heartbeat_key(token, rank) for rank in range(world_size)]
        links.publishing.call("multi_set", keys, [""] * world_size, timeout_s=settings.timeout_s)
    except (OSError, RuntimeError) as error:
        if links is not None:
            links.close(settings.timeout_s)
        where = f" at {address[0]}:{address[1]}" if address is not None else ""
        logger.warning(
            "Telemetry: could not open the heartbeat store%s (%s); hangs are not detected", where, error
        )
        return None
    return offer, links


def _joined(offer: _Offer, settings: HangSettings, rank: int, *, watching: bool) -> _Links | None:
    """This rank's links to the store, joined within `timeout_s`; None (one warning) otherwise."""
    links = _Links.to(offer, settings, watching=watching)
    try:
        links.publishing.connect(settings.timeout_s)
    except StoreUnavailable as error:
        host, port = offer.address or ("", 0)
        logger.warning(
            "Telemetry: rank %d could not join the heartbeat store at %s:%d within timeout_s=%gs (%s); "
            "hang detection is off on this rank (the exporting rank reports it unwatched), training "
            "goes on",
            rank,
            host,
            port,
            settings.timeout_s,
            error,
        )
        links.close(0.0)
        return None
    return links
