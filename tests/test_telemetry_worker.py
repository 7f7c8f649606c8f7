"""What a window's report costs the collector's worker: Python, counted, not timed. The worker runs
beside the training thread, and each of its bytecodes is one the training thread waits for the GIL
for (bench/README.md: half of the training thread's extra CPU at one metric, with a window every 10
steps, was that contention); bench/bench_launches.py times it."""

from __future__ import annotations

import collections
import threading
from types import FrameType
from typing import Any

import torchtelemetry as tt
from tests.ops import OpCounter
from tests.readme_loop import PHASES, ReadmeLoop
from torchtelemetry.collect._collector import _THREAD_PREFIX

WARM_UP = 40
"""Windows before counting: more than the spike history holds (32), so every signal is in its
steady state."""
COUNTED = 10


def _library_calls_per_window() -> collections.Counter[str]:
    """The torchtelemetry functions the collector's worker enters per window of README.md's loop
    (tests/readme_loop.py), signals and the non-finite sentinel on, as by default: the window's
    reduction, compute, naming, signals, totals, report and its console line."""
    calls: collections.Counter[str] = collections.Counter()
    counting = threading.Event()
    workers: dict[int, bool] = {}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        ident = threading.get_ident()
        if ident not in workers:
            workers[ident] = threading.current_thread().name.startswith(_THREAD_PREFIX)
        if event == "call" and workers[ident] and counting.is_set():
            code = frame.f_code
            if "/torchtelemetry/" in code.co_filename:
                calls[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1

    loop = ReadmeLoop()
    threading.setprofile(profile)  # every thread started from now on: the collector's worker
    try:
        telemetry = tt.Telemetry(loop.metrics, every=2, phases=PHASES)
    finally:
        threading.setprofile(None)
    try:
        for index in range(2 * (WARM_UP + COUNTED)):
            if index == 2 * WARM_UP:
                telemetry.flush()  # nothing in flight: the counted windows are whole
                counting.set()
            loop.step(telemetry, index)
        telemetry.flush()
        counting.clear()
        assert telemetry.latest["train/loss"] == 2.0 and telemetry.latest["train/spike/count"] == {
            "train/loss": 0.0
        }
    finally:
        telemetry.close()
    return collections.Counter({name: count / COUNTED for name, count in calls.items()})


def test_a_window_of_the_readme_loop_enters_few_library_functions_on_the_worker() -> None:
    """648 a window before the results' placement and names, the console line's losses and the
    totals' sums were planned once per structure, the spike scores summed in floats and the signals'
    ranks ordered in C; 257 after."""
    calls = _library_calls_per_window()
    assert calls["_publisher.py:publish"] == 1  # one report per window, all of it counted
    assert sum(calls.values()) <= 280, sorted(calls.items(), key=lambda item: -item[1])


def _ops_per_window(loop: ReadmeLoop, *, every: int = 2) -> float:
    """The torch ops the collector's worker dispatches per window of `loop` (a dispatch mode is per
    thread: one is entered on the worker, between two windows, and left there until counted)."""
    telemetry = tt.Telemetry(loop.metrics, every=every, phases=PHASES)
    counter = OpCounter()
    try:
        for index in range(2 * every * WARM_UP):
            loop.step(telemetry, index)
        telemetry.flush()  # nothing in flight: the counted windows are whole
        executor = telemetry._collector._executor
        executor.submit(counter.__enter__).result(timeout=60)
        try:
            for index in range(2 * every * WARM_UP, 2 * every * WARM_UP + every * COUNTED):
                loop.step(telemetry, index)
            telemetry.flush()
        finally:
            executor.submit(counter.__exit__, None, None, None).result(timeout=60)
    finally:
        telemetry.close()
    return sum(counter.ops.values()) / COUNTED


def test_a_window_of_the_readme_loop_costs_the_worker_few_torch_ops() -> None:
    """Each op releases and takes back the GIL, a hand-off with the training thread when both run. 79
    a window before the views of a ring slot's buffers were made once for every window it holds and
    the signals' window states were read without copies (24 then), 13 once the results were copied
    into the last window's flat tensor in one op, 10 once a signal's state was split by one `unbind`."""
    ops = _ops_per_window(ReadmeLoop())
    assert ops <= 11, ops
