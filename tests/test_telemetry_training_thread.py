"""What `Telemetry.step()` costs the training thread: a fixed amount of work whatever the number of
metrics (every per-metric step of a report runs on the collector's worker), and a ring of
`max_pending` slots. Counted, not timed: Python calls and torch ops on the training thread."""

from __future__ import annotations

import collections
import gc
import sys
import time
from types import FrameType
from typing import Any

import torch

import torchtelemetry as tt
from tests.hostsync import CPU_ONLY_READS, NoHostSync
from tests.ops import OpCounter
from tests.readme_loop import PHASES, ReadmeLoop
from tests.step_inputs import step_inputs
from torchtelemetry.report.signals import check_count  # step(tokens=)'s, CPU-only as well

EVERY = 2
STEPS = 12


def _wait_until_collected(telemetry: tt.Telemetry) -> None:
    """Every window in flight done (so that each step() finds the same state whatever the timing)."""
    telemetry._publisher.release()  # what the next step() does first: nothing more is logged
    deadline = time.monotonic() + 60
    while telemetry._collector.pending and not all(w.future.done() for w in telemetry._collector._pending):
        assert time.monotonic() < deadline, "the collector's worker did not finish a window in 60 s"
        time.sleep(0.001)


def _training_thread_work(num_metrics: int) -> tuple[collections.Counter, collections.Counter]:
    """Python calls (by function) and torch ops made inside `step()` on this thread, steady state."""
    metrics = {f"group{i % 10}/metric{i}": tt.SumMetric() for i in range(num_metrics)}
    telemetry = tt.Telemetry(metrics, every=EVERY)
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[getattr(arg, "__qualname__", repr(arg))] += 1

    try:
        for step in range(4):  # warm-up windows
            metrics["group0/metric0"].update(1.0)
            telemetry.step(step)
        telemetry.flush()  # nothing in flight: every measured step starts from the same state
        ops = OpCounter()
        gc.disable()
        for step in range(4, 4 + STEPS):
            metrics["group0/metric0"].update(1.0)
            _wait_until_collected(telemetry)
            sys.setprofile(profile)  # this thread only
            try:
                with ops:
                    telemetry.step(step)
            finally:
                sys.setprofile(None)
        gc.enable()
        telemetry.flush()
        assert telemetry.latest["group0/metric0"] == float(EVERY)
    finally:
        gc.enable()
        telemetry.close()
    return calls, ops.ops


def test_step_does_the_same_work_on_the_training_thread_for_100_and_2000_metrics() -> None:
    _training_thread_work(10)  # first use of the profiler and the dispatch mode imports and caches
    small_calls, small_ops = _training_thread_work(100)
    large_calls, large_ops = _training_thread_work(2000)
    assert large_ops == small_ops
    assert large_calls == small_calls, {
        name: (small_calls[name], large_calls[name])
        for name in small_calls.keys() | large_calls.keys()
        if small_calls[name] != large_calls[name]
    }
    # Naming, flattening and running totals of each report ran on the worker, not here.
    assert not any(name.endswith((":publish", ":flatten_results", ":results")) for name in large_calls)


def test_the_collectors_ring_has_the_telemetrys_max_pending_slots() -> None:
    telemetry = tt.Telemetry({"loss": tt.WeightedMeanMetric()}, every=1, max_pending=3)
    try:
        assert telemetry._collector.max_pending == 3
        assert len(telemetry._collector._transport._slots) == 3
        for step in range(10):  # never more than max_pending windows in flight, none refused
            telemetry.metrics["loss"].update(torch.tensor(float(step)))
            telemetry.step(step)
            assert telemetry._collector.pending <= 3
    finally:
        telemetry.close()
    assert telemetry.latest["loss"] == 9.0


def test_step_in_steady_state_never_syncs_the_device() -> None:
    """Every read of a value on the training thread inside `step()` counts (the tensors are on the CPU
    here, so the detector cannot tell host data from device data), except the reads that only run on
    the CPU (`CPU_ONLY_READS`: the counters' check for negative values, a flush applied in host
    memory) and `step(tokens=)`'s check of its counts (tests/metric/test_no_host_sync.py runs
    `update()` on a device without them)."""
    metrics = {
        "loss": tt.WeightedMeanMetric(),
        "accuracy": tt.AccuracyMetric(),
        "grad_norm": tt.HistogramMetric(bins=[0.5, 1, 2]),
        "tokens": tt.SumMetric(kind="counter"),
    }
    telemetry = tt.Telemetry(metrics, every=2)
    try:
        for step in range(4):  # warm-up windows
            telemetry.step(step, **step_inputs(tokens=torch.tensor(512), samples=4, learning_rate=0.1))
        for step in range(4, 24):
            metrics["loss"].update(torch.tensor(2.0), 512)
            metrics["accuracy"].update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
            metrics["grad_norm"].update(torch.tensor(1.5))
            with NoHostSync(exempt=[*CPU_ONLY_READS, check_count]):
                with telemetry.data_wait():
                    pass
                telemetry.step(step, **step_inputs(tokens=torch.tensor(512), samples=4, learning_rate=0.1))
        telemetry.flush()
        assert telemetry.latest["loss"] == 2.0 and telemetry.latest["train/tokens"] == 24 * 512.0
    finally:
        telemetry.close()


def _library_calls_of_a_step() -> collections.Counter[str]:
    """The torchtelemetry functions README.md's loop enters on the training thread in a step that ends
    no window: the loss, accuracy from logits, a grad-norm histogram, three phases, the data wait and
    `step(tokens=, learning_rate=)` (signals and the non-finite sentinel on, as by default)."""
    loop = ReadmeLoop()
    telemetry = tt.Telemetry(loop.metrics, every=1000, phases=PHASES)
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and "/torchtelemetry/" in frame.f_code.co_filename:
            calls[f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"] += 1

    try:
        for index in range(3):  # the plans of the staged flush are made once
            loop.step(telemetry, index)
        sys.setprofile(profile)  # this thread only
        try:
            loop.step(telemetry, 3)
        finally:
            sys.setprofile(None)
    finally:
        telemetry.close()
    return calls


def test_a_step_of_the_readme_loop_enters_few_library_functions() -> None:
    """What the training thread pays besides its kernels is Python: counted, not timed (each call is a
    fraction of a µs; bench/bench_launches.py times the step against a hand-written loop). 157 before
    the staged path's bookkeeping was cut to a plan per pattern of updates and the prologues read each
    input's metadata once; 121 before an update's entries were staged by one call (one compile check),
    a phase cost its two `with` calls and the flush lost its per-entry calls (75 then)."""
    calls = _library_calls_of_a_step()
    assert sum(calls.values()) <= 82, sorted(calls.items(), key=lambda item: -item[1])


def test_a_step_and_a_window_step_of_the_readme_loop_cost_the_training_thread_few_ops() -> None:
    """On the CPU: the updates' own kernels a step (the staged flush applied in host memory, no op); a
    window step adds the snapshot and the reset (the signals' host values ride the flush: their
    maxima folded in host memory, the sentinel's rank marked from its counts read there). 12 / 17
    before the staged path, 10 / 15 before the window's maxima and the sentinel's mark lost their
    ops, 10 / 12 before the flush did."""
    loop, every = ReadmeLoop(), 2
    telemetry = tt.Telemetry(loop.metrics, every=every, phases=PHASES, window_lines=False)
    plain, windows = [], []
    try:
        for index in range(12 * every):
            with OpCounter() as counter:
                loop.step(telemetry, index)
            if index >= 2 * every:
                ops = sum(counter.ops.values()) - counter.ops["aten.lift_fresh.default"]  # the loop's own
                (windows if index % every == every - 1 else plain).append(ops)  # torch.tensor(grad norm)
    finally:
        telemetry.close()
    assert max(plain) <= 6 and max(windows) <= 8, (plain, windows)
