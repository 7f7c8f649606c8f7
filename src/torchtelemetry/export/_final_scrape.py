"""The scrape endpoint's last duty: the final report of a run reaches the run's scraper.

Only the run's scraper holds `close()` past its timeout, and never for long. A client (by address and
`User-Agent`) that reads the whole exposition (an unfiltered GET) is the run's scraper when it keeps
a steady cadence that `close()` can wait out (`final_scrape_due`):

- at least three whole reads whose last two gaps agree (within a tenth and half a second), or a
  Prometheus (it sends `X-Prometheus-Scrape-Timeout-Seconds`, as the agents built on its scrape code
  do) from its first read, assumed at Prometheus' default minute until it keeps a cadence;
- whose next scrape, an interval and a tenth of it and a second after its last, is due within
  `linger_s` (75 s by default: a Prometheus at its default 60 s interval is due within 67 s).

So two manual reads 10 s apart, a `?name[]=` filtered GET, or a probe every 15 minutes never hold
`close()`; a scraper that let its next scrape pass has stopped and is not waited for either.
`FinalScrapeWait` is that policy, held by `PrometheusExporter`: it keeps, per client, when it read
the endpoint whole and which report it read last (`ScrapeLog`), and at close waits until each of
the run's scrapers has read the final report or let its next scrape pass, at most `linger_s`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_LINGER_S",
    "UNKNOWN_INTERVAL_S",
    "FinalScrapeWait",
    "ScrapeLog",
    "Scraper",
    "final_scrape_due",
]

logger = logging.getLogger(__name__)

DEFAULT_LINGER_S = 75.0
"""The longest `close()` waits for the final scrape: room for the next scrape of a Prometheus at its
default 60 s interval (due within 67 s)."""
UNKNOWN_INTERVAL_S = 60.0
"""The interval assumed after a single scrape by a Prometheus: its default `scrape_interval`."""
_IN_FLIGHT_S = 2.0
"""Before saying it waits, close() lets a scrape that has read the final report finish sending it."""
STOP_S = 1.0
"""What close() gives itself to stop serving after the final scrape."""
_SCRAPES_KEPT = 3
"""Whole reads remembered per client: two gaps, for its cadence."""
_SCRAPERS_KEPT = 16
"""Clients remembered; past that, the one that read least recently is forgotten."""

Scraper = tuple[str, str]
"""A client of the scrape endpoint: (address, User-Agent)."""


def final_scrape_due(
    delivered_at: Sequence[float], now: float, *, prometheus: bool = False, linger_s: float = DEFAULT_LINGER_S
) -> float | None:
    """The `time.monotonic()` by which the run's scraper, with whole reads at `delivered_at` (oldest
    first), has read the endpoint again; None when the client is not the run's scraper (see the
    module) or has stopped (its next scrape is overdue at `now`)."""
    gaps = [later - earlier for earlier, later in itertools.pairwise(delivered_at)][-2:]
    steady = len(gaps) == 2 and abs(gaps[1] - gaps[0]) <= 0.1 * max(gaps) + 0.5
    if steady:
        interval = max(gaps)
    elif prometheus and delivered_at:
        interval = UNKNOWN_INTERVAL_S
    else:
        return None
    wait_s = 1.1 * interval + 1.0
    due = delivered_at[-1] + wait_s
    return due if wait_s <= linger_s and due > now else None


@dataclass(slots=True)
class _Client:
    delivered_at: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_SCRAPES_KEPT)
    )
    generation: int = -1
    """The newest report generation this client read whole."""
    prometheus: bool = False
    """It sent Prometheus' scrape header."""


class ScrapeLog:
    """Who read the endpoint whole, when, and which report each one read last; thread-safe."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._clients: dict[Scraper, _Client] = {}

    def delivered(self, scraper: Scraper, generation: int, *, prometheus: bool = False) -> None:
        """`scraper` read report `generation` whole, now (`prometheus`: with Prometheus' scrape header)."""
        with self._changed:
            entry = self._clients.pop(scraper, None) or _Client()
            self._clients[scraper] = entry  # the most recent last: the first is the one to forget
            if len(self._clients) > _SCRAPERS_KEPT:
                del self._clients[next(iter(self._clients))]
            entry.delivered_at.append(time.monotonic())
            entry.generation = max(entry.generation, generation)
            entry.prometheus = entry.prometheus or prometheus
            self._changed.notify_all()

    def reads(self) -> dict[Scraper, list[float]]:
        """`time.monotonic()` of each client's latest whole reads, oldest first."""
        with self._changed:
            return {scraper: list(entry.delivered_at) for scraper, entry in self._clients.items()}

    def due(self, generation: int, now: float, linger_s: float) -> dict[Scraper, float]:
        """The run's scrapers that have not read report `generation`, each with the time its next
        scrape is due (`final_scrape_due`)."""
        with self._changed:
            due = {
                scraper: final_scrape_due(
                    entry.delivered_at, now, prometheus=entry.prometheus, linger_s=linger_s
                )
                for scraper, entry in self._clients.items()
                if entry.generation < generation
            }
        return {scraper: at for scraper, at in due.items() if at is not None}

    def wait(
        self, generation: int, due: Mapping[Scraper, float], until: float | None = None
    ) -> list[Scraper]:
        """Wait until every scraper of `due` has read report `generation` or let its due time pass
        (or `until`); return those that have not read it."""
        with self._changed:
            while True:
                now = time.monotonic()
                unread = [scraper for scraper in due if self._generation(scraper) < generation]
                ends = [due[scraper] if until is None else min(due[scraper], until) for scraper in unread]
                waiting = [end for end in ends if end > now]
                if not waiting:
                    return unread
                self._changed.wait(min(waiting) - now)

    def _generation(self, scraper: Scraper) -> int:
        entry = self._clients.get(scraper)
        return -1 if entry is None else entry.generation


class FinalScrapeWait:
    """How long a scrape endpoint's `close()` serves its final report (see the module): until the
    run's scrapers have read it, at most `linger_s` (0: never waits). Thread-safe."""

    def __init__(self, linger_s: float = DEFAULT_LINGER_S) -> None:
        self.linger_s = linger_s
        self.log = ScrapeLog()
        self._lock = threading.Lock()
        self._until: float | None = None
        self._done = False

    def delivered(self, scraper: Scraper, generation: int, *, prometheus: bool = False) -> None:
        """`scraper` read report `generation` whole, now."""
        self.log.delivered(scraper, generation, prometheus=prometheus)

    def closing_until(self, final: int) -> float | None:
        """The `time.monotonic()` by which a close returns: the one serving its final report now, or
        one started now whose final report would be `final`; None when it does not wait (and once
        it has served it)."""
        with self._lock:
            if self._done or self._until is not None:
                return self._until
        due = self.log.due(final, time.monotonic(), self.linger_s)
        return max(due.values()) + STOP_S if due else None

    def serve(self, final: int, subject: str, url: str | None) -> None:
        """Wait until the run's scrapers have read report `final` or let their next scrape pass,
        logging for whom it waits (`subject` and `url` name the endpoint)."""
        due = self.log.due(final, time.monotonic(), self.linger_s)
        with self._lock:
            self._until = max(due.values()) + STOP_S if due else None
        try:
            if due and self.log.wait(final, due, until=time.monotonic() + _IN_FLIGHT_S):
                self._wait(final, due, subject, url)
        finally:
            with self._lock:
                self._until, self._done = None, True

    def _wait(self, final: int, due: Mapping[Scraper, float], subject: str, url: str | None) -> None:
        logger.info(
            "%s: waiting up to %.0f s for %s to read the final report at %s (its next scrape is due "
            "then; close() waits past its timeout for it, at most linger_s=%gs)",
            subject,
            max(due.values()) - time.monotonic(),
            _names(due),
            url,
            self.linger_s,
        )
        unread = self.log.wait(final, due)
        if unread:
            logger.warning(
                "%s: %s did not read the final report by the time its next scrape was due; closing "
                "without it",
                subject,
                _names(unread),
            )


def _names(scrapers: Iterable[Scraper]) -> str:
    """`127.0.0.1 (Prometheus/2.45.0)`, ... for the log."""
    return ", ".join(f"{address} ({agent or 'no User-Agent'})" for address, agent in scrapers)
