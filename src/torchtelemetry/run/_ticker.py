"""`Ticker`: a named daemon thread that does one thing every interval until it is closed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["Ticker"]

logger = logging.getLogger(__name__)


class Ticker:
    """Calls `tick()` every `interval_s` on a daemon thread named `name`, until `close()`. A tick that
    raises is logged (the first of a run of failures, as `what`) and the next one comes all the same."""

    def __init__(self, tick: Callable[[], None], *, name: str, interval_s: float, what: str) -> None:
        self._tick = tick
        self._interval_s = interval_s
        self._what = what
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._tick()
            except Exception as error:  # a watcher that stopped must say so, once per run of failures
                if not self._failing:
                    logger.error("Telemetry: %s failed: %s: %s", self._what, type(error).__name__, error)
                self._failing = True
            else:
                self._failing = False

    def close(self, timeout_s: float) -> None:
        """Stop ticking; return once the thread ended, or after `timeout_s`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
