"""`make gpu-check`: the `cuda`-marked tests and what a GPU user needs measured, on a busy GPU, as one table.

Runs on a bare, offline GPU image (python3, torch with CUDA, pytest, numpy, prometheus-client; no
venv, no pip, no network), from the repository root, sized to fit in five minutes on one GPU (on an
H200, 2026-11-28: about 100 s, the tests 66 s; the table is in bench/README.md):

    PYTHONPATH=src python3 -m bench.gpu_check      # or: make gpu-check

1. Runs `pytest -m cuda tests` in this process (test modules whose optional test dependencies are
   missing are skipped by `pytest.importorskip`, not errors).
2. Measures with the GPU busy: a `torch.cuda._sleep` is queued before every measured call, so a
   call that waits for the device (a host sync) takes that long and leaves the stream idle, and a
   wait on the worker shows in its CPU time. Rows, each with a verdict against its budget below:
   `update()` against its floor (the same kernels on plain tensors); `Telemetry.step()`'s CPU on the
   training thread on window steps and on other steps, per transport, with phases, the non-finite
   sentinel and memory health on; the steps that returned while the stream was busy; the CUDA
   driver's syncs per step (`torch.cuda.set_sync_debug_mode("warn")`) and `tests.hostsync.NoHostSync`'s;
   the worker's CPU while it waits one second, per transport; the thread of every NCCL
   collective; `schedule_collection()` under `TORCH_NCCL_BLOCKING_WAIT=1`; the kernels a step of
   K = 1, 16, 64 weighted means launches (the profiler's CUDA activities: staged updates cost the
   same few whatever K); the demo's TinyLM under DDP (world of one) with and without the demo's
   metrics, phases and signals (`bench.gpu_ddp.cost`); and the outcome of the tests that capture
   `update()` in a CUDA graph while windows are in flight and that free slots under three windows
   in flight (`record_stream`).
3. Exit status: 0 every row passed; 1 a row or a test failed, no test ran, or a test module failed
   to import; 2 no CUDA device (after collecting the tests, so that a CPU machine proves they import).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests.distributed import nccl_world_of_one
from tests.gpu import busy_for, collector_worker, thread_cpu_clock
from tests.hostsync import NoHostSync
from tests.sync.collectives import CollectiveRecorder

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector

UPDATE_RATIO = 1.5
"""`update()` of a 0-d weighted mean may cost this many times its floor (bench/README.md's target)."""
WINDOW_STEP_CPU_US = {"host": 300.0, "device": 3000.0}
"""Training-thread CPU of a `Telemetry.step()` that schedules a window (the staged updates and host
values applied, the snapshot, the event, the hand-off), per transport. The device transport also
launches the window's collective, compute and packed copy from the training thread (NCCL's thread
rule): on an H200 host (2026-11-28, before staged updates) 937 µs host, 2368 µs device."""
KERNELS_PER_STEP = 8
"""Kernels (CUDA activities) a step of K weighted means launches, updates and `Telemetry.step()`, for
every K (issue 44: a step costs the same few launches however many metrics it updates)."""
TINYLM_OVERHEAD_PCT = 3.0
"""Steps per second the demo's launch-bound TinyLM may lose to the demo's metrics, phases and signals."""
OTHER_STEP_CPU_US = 300.0
"""Training-thread CPU of any other `Telemetry.step()` (the per-step signals)."""
WORKER_WAIT_CPU_SHARE = 0.05
"""The worker's CPU while it waits for the device, as a share of the wait (spinning: about 1)."""
STEP_GPU_S = 0.005
"""GPU work queued before each measured step (the training step the host runs ahead of)."""


@dataclass(frozen=True, slots=True)
class Row:
    check: str
    figure: str
    passed: bool


class _Outcomes:
    """A pytest plugin keeping each test's outcome and the modules that failed to import."""

    def __init__(self) -> None:
        self.rows: dict[str, str] = {}
        self.collected = 0
        self.import_errors: list[str] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.import_errors.append(report.nodeid)

    def pytest_collection_finish(self, session: Any) -> None:
        self.collected = len(session.items)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.rows[report.nodeid] = report.outcome

    def count(self, outcome: str) -> int:
        return sum(result == outcome for result in self.rows.values())

    def row(self, check: str, test: str) -> Row:
        """A row holding the outcome of every parametrization of `test` (a test function's name)."""
        found = {node: outcome for node, outcome in self.rows.items() if f"::{test}" in node}
        passed = bool(found) and all(outcome == "passed" for outcome in found.values())
        figure = ", ".join(f"{outcome}" for outcome in found.values()) or "not run"
        return Row(check, f"{figure} ({test})", passed)


def _run_tests(outcomes: _Outcomes, collect_only: bool) -> None:
    arguments = ["-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", "tests"]
    pytest.main([*arguments, "--collect-only"] if collect_only else arguments, plugins=[outcomes])


# -- update() -------------------------------------------------------------------------------------


def _update_row(calls: int, rounds: int) -> Row:
    """µs per `update(loss, tokens)` of a 0-d weighted mean and of its floor, each timed right after a
    long sleep was queued (the launches queue behind it), fastest of `rounds`."""
    loss, tokens = torch.tensor(2.5, device="cuda"), torch.tensor(512, device="cuda")
    metric = tt.WeightedMeanMetric().to("cuda")
    weighted = torch.zeros((), dtype=torch.float64, device="cuda")
    weight = torch.zeros((), dtype=torch.float64, device="cuda")

    def floor() -> None:
        weighted.addcmul_(loss, tokens)
        weight.add_(tokens)

    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for index, call in enumerate((lambda: metric.update(loss, tokens), floor)):
            torch.cuda.synchronize()
            busy_for(0.05)
            started = time.perf_counter()
            for _ in range(calls):
                call()
            best[index] = min(best[index], (time.perf_counter() - started) / calls * 1e6)
    update_us, floor_us = best
    return Row(
        "update() of a 0-d weighted mean vs its floor",
        f"{update_us:.2f} µs vs {floor_us:.2f} µs ({update_us / floor_us:.2f}x, budget {UPDATE_RATIO}x)",
        update_us <= UPDATE_RATIO * floor_us,
    )


# -- Telemetry.step() --------------------------------------------------------------------------


def _telemetry_metrics(transport: str) -> dict[str, tt.Metric]:
    """Metrics `"auto"` sends through `transport`: a confusion matrix over 600 classes (2.9 MB)
    takes the device transport on an NCCL group."""
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric(), "accuracy": tt.AccuracyMetric()}
    if transport == "device":
        metrics["confusion"] = tt.ConfusionMatrixMetric(600)
    return {name: metric.to("cuda") for name, metric in metrics.items()}


def _train(telemetry: tt.Telemetry, metrics: dict[str, tt.Metric], steps: range, measure: Callable) -> None:
    """`steps` training steps: queue the step's GPU work, update inside a phase, then `measure(step)`
    (which calls `telemetry.step`); the host then waits for the previous step's GPU work, as a
    training loop that reads its loss one step late does, so the stream stays busy when it steps."""
    loss = torch.tensor(0.5, device="cuda")
    logits, labels = torch.randn(64, 10, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
    previous: torch.cuda.Event | None = None
    for step in steps:
        slept = busy_for(STEP_GPU_S)
        with telemetry.phase("forward"):
            metrics["loss"].update(loss, 512)
            metrics["accuracy"].update(logits, labels)
            if "confusion" in metrics:
                metrics["confusion"].update(labels, labels)
        measure(step)
        if previous is not None:
            previous.synchronize()
        previous = slept


def _telemetry_rows(transport: str, steps: int) -> list[Row]:
    metrics = _telemetry_metrics(transport)
    tokens = torch.tensor(512, device="cuda")
    telemetry = tt.Telemetry(metrics, every=10, nonfinite=["loss"])
    window_cpu: list[float] = []
    other_cpu: list[float] = []
    returned_busy = 0

    def timed(step: int) -> None:
        nonlocal returned_busy
        started = time.thread_time()
        telemetry.step(step, tokens=tokens, learning_rate=1e-3)
        (window_cpu if step % 10 == 9 else other_cpu).append(time.thread_time() - started)
        returned_busy += not torch.cuda.current_stream().query()

    detector = NoHostSync(collect=True)
    driver_syncs: list[Any] = []

    def detected(step: int) -> None:
        torch.cuda.set_sync_debug_mode("warn")  # process-wide: the worker's syncs count too
        try:
            with warnings.catch_warnings(record=True) as caught, detector:
                warnings.simplefilter("always")
                telemetry.step(step, tokens=tokens, learning_rate=1e-3)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        driver_syncs.extend(w for w in caught if "synchroniz" in str(w.message))

    try:
        in_use = telemetry._collector.transport_in_use()
        _train(telemetry, metrics, range(20), lambda step: telemetry.step(step, tokens=tokens))  # warm-up
        _train(telemetry, metrics, range(20, 20 + steps), timed)
        _train(telemetry, metrics, range(20 + steps, 20 + 2 * steps), detected)
        telemetry.flush()
    finally:
        telemetry.close()
    driver = len(driver_syncs)
    window_us, other_us = statistics.median(window_cpu) * 1e6, statistics.median(other_cpu) * 1e6
    label = f"Telemetry.step(), {in_use} transport (phases, sentinel, memory health on)"
    return [
        Row(
            f"{label}: window steps",
            f"{window_us:.0f} µs CPU (budget {WINDOW_STEP_CPU_US[transport]:.0f})",
            in_use == transport and window_us <= WINDOW_STEP_CPU_US[transport],
        ),
        Row(
            f"{label}: other steps",
            f"{other_us:.0f} µs CPU (budget {OTHER_STEP_CPU_US:.0f})",
            other_us <= OTHER_STEP_CPU_US,
        ),
        Row(
            f"{label}: returned while the stream was busy",
            f"{returned_busy} of {steps} steps",
            returned_busy == steps,
        ),
        Row(
            f"{label}: host syncs per step",
            f"{driver / steps:g} (CUDA driver), {len(detector.seen) / steps:g} (NoHostSync)",
            driver == 0 and not detector.seen,
        ),
    ]


def _kernels_per_step(k: int, steps: int) -> float:
    """CUDA activities (kernels, copies) per step of K weighted means, each updated with a 0-d loss
    and a Python token count, and `Telemetry.step()`; steps that end no window, the GPU busy."""
    metrics = {f"train/m{i}": tt.WeightedMeanMetric().to("cuda") for i in range(k)}
    losses = [torch.rand((), device="cuda") for _ in range(k)]
    telemetry = tt.Telemetry(metrics, every=10_000, phases=())
    try:
        for step in range(20 + steps):
            if step == 20:
                torch.cuda.synchronize()
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                profiler.__enter__()
            for metric, loss in zip(metrics.values(), losses, strict=True):
                metric.update(loss, 512)
            telemetry.step(step)
        torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
    finally:
        telemetry.close()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for event in profiler.events() if event.device_type == cuda) / steps


def _kernels_row(steps: int) -> Row:
    counts = {k: _kernels_per_step(k, steps) for k in (1, 16, 64)}
    return Row(
        "kernels per step of K weighted means (updates and Telemetry.step()), K = 1 / 16 / 64",
        " / ".join(f"{count:g}" for count in counts.values())
        + f" (budget: the same for every K, at most {KERNELS_PER_STEP})",
        len(set(counts.values())) == 1 and max(counts.values()) <= KERNELS_PER_STEP,
    )


def _tinylm_row(blocks: int, steps_per_block: int) -> Row:
    """The demo's TinyLM under DDP on this GPU (a world of one): blocks with and without the demo's
    metrics, phases and signals alternate (`bench.gpu_ddp.cost`)."""
    from bench.gpu_ddp import SHAPES, cost

    measured = cost(SHAPES["demo"], blocks, steps_per_block, torch.device("cuda"))
    step_cpu = measured["step_cpu_us"]
    return Row(
        "demo TinyLM: steps/s lost to the demo's metrics, phases and signals",
        f"{measured['overhead_pct']:.1f} % (step() CPU: window {step_cpu['window']:.0f} µs, other "
        f"{step_cpu['other']:.0f} µs; budget {TINYLM_OVERHEAD_PCT:g} %)",
        measured["overhead_pct"] <= TINYLM_OVERHEAD_PCT,
    )


# -- the worker, and blocking wait ---------------------------------------------------------------


def _worker_wait_row(transport: str) -> Row:
    """The worker's CPU while the window it waits for is behind one second of GPU work."""
    metrics = _telemetry_metrics(transport)
    with AsyncMetricCollector(metrics, transport=transport) as collector:  # type: ignore[arg-type]
        cpu = thread_cpu_clock(collector_worker())
        torch.cuda.synchronize()
        started, slept = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        busy_for(1.0)
        slept.record()
        collector.schedule_collection()
        cpu_before = cpu()
        collector.collect_results()
        worker_cpu = cpu() - cpu_before
    waited = started.elapsed_time(slept) / 1000
    return Row(
        f"worker CPU while it waits for the device, {transport} transport",
        f"{worker_cpu * 1e3:.1f} ms in a {waited:.2f} s wait (budget {WORKER_WAIT_CPU_SHARE:.0%})",
        worker_cpu <= WORKER_WAIT_CPU_SHARE * waited,
    )


def _nccl_threads_row(calls: list[Any]) -> Row:
    nccl = [call for call in calls if "nccl" in call.backend]
    threads = sorted({call.thread for call in nccl})
    return Row(
        "thread of every NCCL collective",
        f"{len(nccl)} collectives on {', '.join(threads) or 'no thread'}",
        bool(nccl) and threads == ["MainThread"],
    )


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _blocking_wait_row() -> Row:
    """`schedule_collection()` of a window `"auto"` would send through the device transport, on an
    NCCL group created under `TORCH_NCCL_BLOCKING_WAIT=1`, one second of GPU work before it."""
    with _environment("TORCH_NCCL_BLOCKING_WAIT", "1"), nccl_world_of_one():
        metrics = _telemetry_metrics("device")
        with AsyncMetricCollector(metrics) as collector:
            in_use = collector.transport_in_use()
            torch.cuda.synchronize()
            busy_for(1.0)
            started = time.thread_time()
            collector.schedule_collection()
            cpu_us = (time.thread_time() - started) * 1e6
            busy = not torch.cuda.current_stream().query()
            collector.collect_results()
    return Row(
        "schedule_collection() under TORCH_NCCL_BLOCKING_WAIT=1",
        f"{in_use} transport, {cpu_us:.0f} µs CPU, returned while the stream was busy: {busy}",
        in_use == "host" and busy,
    )


# -- the table -----------------------------------------------------------------------------------


def _measure(outcomes: _Outcomes, steps: int) -> list[Row]:
    failed = [test for test, outcome in outcomes.rows.items() if outcome == "failed"]
    rows = [
        Row(
            "cuda tests",
            f"{outcomes.count('passed')} passed, {len(failed)} failed, {outcomes.count('skipped')} skipped",
            bool(outcomes.rows) and not failed and not outcomes.import_errors,
        ),
        *(Row("failed test", test, False) for test in failed),
        *(Row("test module failed to import", module, False) for module in outcomes.import_errors),
        _update_row(calls=200, rounds=5),
    ]
    with nccl_world_of_one(), CollectiveRecorder() as calls:
        for transport in ("host", "device"):
            rows += _telemetry_rows(transport, steps)
        rows += [_worker_wait_row(transport) for transport in ("host", "device")]
        rows.append(_kernels_row(steps=20))
    rows.append(_nccl_threads_row(calls))
    with nccl_world_of_one():  # DDP's own all-reduce is not one of ours: outside the recorder
        rows.append(_tinylm_row(blocks=3, steps_per_block=100))
    rows += [
        outcomes.row(
            "graph capture of update() while windows are in flight (thread_local)",
            "test_update_is_captured_in_a_cuda_graph_while_windows_are_in_flight",
        ),
        outcomes.row(
            "record_stream: three windows in flight, timed-out unbind(), fresh allocations",
            "test_a_timed_out_unbind_never_hands_out_memory_the_side_stream_still_writes",
        ),
        _blocking_wait_row(),
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=100, help="measured Telemetry.step() calls per transport"
    )
    args = parser.parse_args()
    outcomes = _Outcomes()
    if not torch.cuda.is_available():
        _run_tests(outcomes, collect_only=True)
        if outcomes.import_errors:
            print(f"\ngpu-check: test modules failed to import: {outcomes.import_errors}")
            sys.exit(1)
        print(
            f"\ngpu-check: {outcomes.collected} cuda tests collected, every test module imports; no CUDA "
            f"device to run them on (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
            "torch.cuda.is_available() is False)"
        )
        sys.exit(2)
    _run_tests(outcomes, collect_only=False)
    rows = _measure(outcomes, args.steps)
    print(f"\ntorch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print("| check | figure | verdict |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row.check} | {row.figure} | {'pass' if row.passed else 'FAIL'} |")
    sys.exit(0 if all(row.passed for row in rows) else 1)


if __name__ == "__main__":
    main()
