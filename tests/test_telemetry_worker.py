"""What a window's report costs the collector's worker: Python, counted, not timed. The worker runs
beside the training thread, and each of its bytecodes is one the training thread waits for the GIL
for (bench/README.md: half of the training thread's extra CPU at one metric, with a window every 10
steps, was that contention); bench/bench_launches.py times it."""

from __future__ import annotations

import collections
import threading
from types import FrameType
from typing import Any

import torch

import torchtelemetry as tt
from torchtelemetry.collect._collector import _THREAD_PREFIX

PHASES = ("forward", "backward", "optimizer")
WARM_UP = 40
"""Windows before counting: more than the spike history holds (32), so every signal is in its
steady state."""
COUNTED = 10


def _library_calls_per_window() -> collections.Counter[str]:
    """The torchtelemetry functions the collector's worker enters per window of README.md's loop:
    the loss, accuracy from logits, a grad-norm histogram, three phases, the data wait and
    `step(tokens=, learning_rate=)`, signals and the non-finite sentinel on, as by default (the
    window's reduction, compute, naming, signals, totals, report and its console line)."""
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

    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "accuracy": tt.AccuracyMetric(),
            "grad_norm": tt.HistogramMetric(bins=[0.1, 0.5, 1, 2, 5, 10]),
        }
    }
    loss, logits, targets = torch.tensor(2.0), torch.randn(8, 4), torch.tensor([0, 1, 2, 3] * 2)
    threading.setprofile(profile)  # every thread started from now on: the collector's worker
    try:
        telemetry = tt.Telemetry(metrics, every=2, phases=PHASES)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        for index in range(2 * (WARM_UP + COUNTED)):
            if index == 2 * WARM_UP:
                telemetry.flush()  # nothing in flight: the counted windows are whole
                counting.set()
            with telemetry.data_wait():
                pass
            for phase in PHASES:
                with telemetry.phase(phase):
                    pass
            metrics["train"]["loss"].update(loss, targets.numel())
            metrics["train"]["accuracy"].update(logits, targets)
            metrics["train"]["grad_norm"].update(torch.tensor(1.5))
            telemetry.step(index, tokens=targets.numel(), learning_rate=0.1)
        telemetry.flush()
        counting.clear()
        assert telemetry.latest["train/loss"] == 2.0 and telemetry.latest["train/spike/count"] == {
            "train/loss": 0.0
        }
    finally:
        telemetry.close()
    return collections.Counter({name: count / COUNTED for name, count in calls.items()})


def test_a_window_of_the_readme_loop_enters_few_library_functions_on_the_worker() -> None:
    """648 per window before the results' placement, their names, the console line's losses and the
    totals were planned once per structure and the spike scores summed in floats."""
    calls = _library_calls_per_window()
    assert calls["_publisher.py:publish"] == 1  # one report per window, all of it counted
    assert sum(calls.values()) <= 280, sorted(calls.items(), key=lambda item: -item[1])
