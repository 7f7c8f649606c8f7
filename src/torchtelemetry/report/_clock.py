"""The clock of every timestamp a run exports: the wall time when torchtelemetry was imported plus the
monotonic time since, so that timestamps never go back when the system clock is set back (NTP
stepping it, an operator, a VM restored from a snapshot) and a counter's start time stays put."""

from __future__ import annotations

import time

__all__ = ["wall_time"]

_WALL_AT_IMPORT = time.time()
_MONOTONIC_AT_IMPORT = time.monotonic()


def wall_time() -> float:
    """Unix seconds, monotone within the process: the wall time at import plus monotonic time since."""
    return _WALL_AT_IMPORT + (time.monotonic() - _MONOTONIC_AT_IMPORT)
