"""Helpers for the `cuda`-marked tests and `bench.gpu_check`: a busy training stream, and the CPU a
thread spends (importable without a GPU; every function needs one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

__all__ = ["busy_for", "collector_worker", "thread_cpu_clock"]

_CYCLES_PER_SECOND: list[float] = []


def busy_for(seconds: float) -> torch.cuda.Event:
    """Queue `torch.cuda._sleep` for at least about `seconds` on the current stream (calibrated once,
    at the fastest clock seen); the returned event completes when the sleep does."""
    if not _CYCLES_PER_SECOND:
        # An idle GPU clocks down (an H200 read 345 MHz idle, 1980 MHz busy): wake it first, and keep
        # the fastest of three rates, so a sleep lasts at least `seconds` at any clock seen.
        torch.cuda._sleep(100_000_000)
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(100_000_000)
            end.record()
            end.synchronize()
            rates.append(100_000_000 / (start.elapsed_time(end) / 1000))
        _CYCLES_PER_SECOND.append(max(rates))
    torch.cuda._sleep(int(_CYCLES_PER_SECOND[0] * seconds))
    slept = torch.cuda.Event()
    slept.record()
    return slept


def collector_worker() -> threading.Thread:
    """The only live collector worker thread (fails if there is none or several)."""
    (worker,) = [t for t in threading.enumerate() if t.name.startswith("torchtelemetry-collector")]
    return worker


def thread_cpu_clock(thread: threading.Thread) -> Callable[[], float]:
    """The CPU seconds `thread` has used so far, as a function."""
    clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
    return lambda: time.clock_gettime(clock)
