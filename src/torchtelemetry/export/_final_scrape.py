"""The scrape endpoint's last duty: the final report of a run reaches the scrapers that scraped it.

A scraper is a client, by address and `User-Agent`, that has read the whole exposition (an
unfiltered GET) at least twice, so it keeps a cadence and its next scrape is due at a time the
endpoint can tell (`final_scrape_due`), or once with the `X-Prometheus-Scrape-Timeout-Seconds`
header Prometheus (and the agents built on its scrape code) sends, whose next scrape is then
assumed due at Prometheus' default interval, a minute. A liveness probe, a `?name[]=` filtered GET
or a single manual `curl` is no scraper: it neither ends the wait for the final scrape nor makes one.
`ScrapeLog` keeps, per scraper, when it read the endpoint whole and which report it read last;
`PrometheusExporter.close()` waits on it until every scraper that keeps its cadence has read the
final report (or missed its next scrape: it stopped).

While a closed run waits so, its endpoint is in the linger registry, by the addresses its host
resolves to: a new exporter on an endpoint that overlaps it (`localhost` and `127.0.0.1`, or a
wildcard address, on the same port) ends that wait before it binds, instead of failing with
`Address already in use`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["UNKNOWN_INTERVAL_S", "ScrapeLog", "Scraper", "end_lingering", "final_scrape_due", "lingering"]

logger = logging.getLogger(__name__)

UNKNOWN_INTERVAL_S = 60.0
"""The interval assumed after a single scrape by a Prometheus: its default `scrape_interval`."""
_SCRAPES_KEPT = 9
"""Whole reads remembered per scraper, for its cadence."""
_SCRAPERS_KEPT = 16
"""Scrapers remembered; past that, the one that read least recently is forgotten."""
_WILDCARDS = frozenset({"0.0.0.0", "::"})

Scraper = tuple[str, str]
"""A client of the scrape endpoint: (address, User-Agent)."""


def final_scrape_due(delivered_at: Sequence[float], now: float, *, prometheus: bool = False) -> float | None:
    """The `time.monotonic()` by which a scraper keeping its cadence has read the endpoint again, or None
    when it is no scraper or has stopped.

    Prometheus scrapes a target at a fixed interval: the cadence is the median gap between the
    reads seen, and the next read is due one interval after the last, with half an interval and a
    second of slack. After a single read there is no cadence: a client that said it is a Prometheus
    (`prometheus`) is due within `UNKNOWN_INTERVAL_S` and a second, any other is no scraper. A scraper
    that let its due time pass has stopped (a removed target, a Prometheus gone): nothing is coming,
    nothing is waited for.
    """
    if not delivered_at or (len(delivered_at) == 1 and not prometheus):
        return None
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(delivered_at))
    due = delivered_at[-1] + (1.5 * gaps[len(gaps) // 2] if gaps else UNKNOWN_INTERVAL_S) + 1.0
    return due if due > now else None


@dataclass(slots=True)
class _Scraper:
    delivered_at: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_SCRAPES_KEPT)
    )
    generation: int = -1
    """The newest report generation this scraper read whole."""
    prometheus: bool = False
    """It sent Prometheus' scrape header."""


class ScrapeLog:
    """Who read the endpoint whole, when, and which report each one read last; thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._scrapers: dict[Scraper, _Scraper] = {}
        self._interrupted = False

    def delivered(self, scraper: Scraper, generation: int, *, prometheus: bool = False) -> None:
        """`scraper` read report `generation` whole, now (`prometheus`: with Prometheus' scrape header)."""
        with self._changed:
            entry = self._scrapers.pop(scraper, None) or _Scraper()
            self._scrapers[scraper] = entry  # the most recent last: the first is the one to forget
            if len(self._scrapers) > _SCRAPERS_KEPT:
                del self._scrapers[next(iter(self._scrapers))]
            entry.delivered_at.append(time.monotonic())
            entry.generation = max(entry.generation, generation)
            entry.prometheus = entry.prometheus or prometheus
            self._changed.notify_all()

    def reads(self) -> dict[Scraper, list[float]]:
        """`time.monotonic()` of each scraper's latest whole reads, oldest first."""
        with self._changed:
            return {scraper: list(entry.delivered_at) for scraper, entry in self._scrapers.items()}

    def due(self, generation: int, now: float) -> dict[Scraper, float]:
        """The scrapers keeping their cadence that have not read report `generation`, each with the
        time its next scrape is due (`final_scrape_due`)."""
        with self._changed:
            due = {
                scraper: final_scrape_due(entry.delivered_at, now, prometheus=entry.prometheus)
                for scraper, entry in self._scrapers.items()
                if entry.generation < generation
            }
        return {scraper: at for scraper, at in due.items() if at is not None}

    def wait(
        self, generation: int, due: Mapping[Scraper, float], until: float | None = None
    ) -> list[Scraper]:
        """Wait until every scraper of `due` has read report `generation` or let its due time pass
        (or `until`, or `interrupt()`); return those that have not read it."""
        with self._changed:
            while True:
                now = time.monotonic()
                unread = [scraper for scraper in due if self._generation(scraper) < generation]
                waiting = [due[scraper] for scraper in unread if due[scraper] > now]
                if until is not None:
                    waiting = [min(at, until) for at in waiting if until > now]
                if not waiting or self._interrupted:
                    return unread
                self._changed.wait(min(waiting) - now)

    def interrupt(self) -> None:
        """End `wait()` now (a new exporter takes the endpoint)."""
        with self._changed:
            self._interrupted = True
            self._changed.notify_all()

    def _generation(self, scraper: Scraper) -> int:
        entry = self._scrapers.get(scraper)
        return -1 if entry is None else entry.generation


@dataclass(frozen=True, slots=True)
class _Lingering:
    addresses: frozenset[str]
    port: int
    log: ScrapeLog
    ended: threading.Event


# Process-global: a port is bound by the process, so the endpoints lingering on them are per process.
_lingering: list[_Lingering] = []
"""Endpoints of closed runs still serving the final report, waiting for its scrape."""
# Process-global: guards `_lingering`, which every exporter of the process shares.
_lingering_lock = threading.Lock()


def _addresses(addr: str, port: int) -> frozenset[str]:
    """The IP addresses `addr` binds to (`localhost`: 127.0.0.1 and ::1), or `addr` if it does not resolve."""
    try:
        found = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return frozenset({addr})
    return frozenset(str(sockaddr[0]) for *_, sockaddr in found)


def _overlap(first: frozenset[str], second: frozenset[str]) -> bool:
    return bool(first & second or (first | second) & _WILDCARDS)


@contextlib.contextmanager
def lingering(addr: str, port: int, log: ScrapeLog) -> Iterator[threading.Event]:
    """Register `addr:port` as lingering on `log` while the block runs; the event it yields is set
    once the block is left (the endpoint then closed), for `end_lingering` to wait on."""
    entry = _Lingering(_addresses(addr, port), port, log, threading.Event())
    with _lingering_lock:
        _lingering.append(entry)
    try:
        yield entry.ended
    finally:
        with _lingering_lock:
            _lingering.remove(entry)
        entry.ended.set()


def end_lingering(addr: str, port: int, name: str, timeout_s: float) -> None:
    """End the wait of every closed run lingering on an endpoint that overlaps `addr:port`, and wait
    (at most `timeout_s`) until it has stopped serving, for a new exporter to bind the port."""
    addresses = _addresses(addr, port)
    with _lingering_lock:
        found = [entry for entry in _lingering if entry.port == port and _overlap(entry.addresses, addresses)]
    for entry in found:
        logger.warning(
            "PrometheusExporter %r: port %d still served the final report of a closed run (on %s); "
            "it is not scraped now",
            name,
            port,
            ", ".join(sorted(entry.addresses)),
        )
        entry.log.interrupt()
    deadline = time.monotonic() + timeout_s
    for entry in found:
        entry.ended.wait(max(0.0, deadline - time.monotonic()))
