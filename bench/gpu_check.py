"""`make gpu-check`: the `cuda`-marked tests and the GPU figures of the collection, as one table.

Runs on a bare, offline GPU image (python3, torch with CUDA, pytest, numpy, prometheus-client; no
venv, no pip, no network), from the repository root:

    PYTHONPATH=src python3 -m bench.gpu_check [--windows 200]      # or: make gpu-check

1. Runs `pytest -m cuda tests` in this process (test modules whose optional test dependencies
   are missing, e.g. hypothesis or yaml, are skipped by `pytest.importorskip`, not errors).
2. Measures on the GPU: `update()` of a 0-d weighted mean against its floor (the same two kernels
   on plain float64 tensors); `schedule_collection()` on the training thread (median wall and CPU)
   per transport for K = 1, 16 and 128 metrics (weighted mean / sum / max / min), with the worker's
   CPU per window and the latency to Python values, in a 1-rank NCCL group (the device transport
   issues a real NCCL collective, the host transport a real gloo one); host syncs per
   `Telemetry.step()` in steady state (the CUDA driver's count under
   `torch.cuda.set_sync_debug_mode("warn")` and `tests.hostsync.NoHostSync`'s); and overlap: how
   many windows were in Python while the training stream still ran a long kernel queued after them.
3. Prints one Markdown table. Exit status: 0 all passed; 1 a test failed, none ran, or a test
   module failed to import; 2 no CUDA device (after collecting the tests, so that a CPU machine
   proves they import).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from tests.distributed import nccl_world_of_one
from tests.hostsync import NoHostSync

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
_SIZES = (1, 16, 128)


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


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _update_figures(updates: int) -> tuple[float, float]:
    """µs per `update(loss, tokens)` of a 0-d weighted mean and of its floor, fastest of 5 rounds."""
    loss, tokens = torch.tensor(2.5, device="cuda"), torch.tensor(512, device="cuda")
    metric = tt.WeightedMeanMetric().to("cuda")
    weighted = torch.zeros((), dtype=torch.float64, device="cuda")
    weight = torch.zeros((), dtype=torch.float64, device="cuda")

    def floor() -> None:
        weighted.addcmul_(loss, tokens)
        weight.add_(tokens)

    best = [float("inf"), float("inf")]
    for _ in range(5):
        for index, call in enumerate((lambda: metric.update(loss, tokens), floor)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(updates):
                call()
            best[index] = min(best[index], (time.perf_counter() - started) / updates * 1e6)
    return best[0], best[1]


def _window_figures(k: int, transport: str, windows: int) -> dict[str, float]:
    metrics = {f"m{i:03d}": _KINDS[i % len(_KINDS)]() for i in range(k)}
    value = torch.tensor(1.5, device="cuda")
    schedule, schedule_cpu, latency, overlapped = [], [], [], 0
    collector = AsyncMetricCollector(metrics, device="cuda", transport=transport, timeout_s=60)  # type: ignore[arg-type]
    with collector:
        worker = next(t for t in threading.enumerate() if t.name.startswith("torchtelemetry-collector"))
        clock = time.pthread_getcpuclockid(worker.ident)  # type: ignore[arg-type]
        worker_cpu = 0.0
        for window in range(windows + 5):
            for metric in metrics.values():
                metric.update(value)
            torch.cuda.synchronize()
            worker_started = time.clock_gettime(clock)
            started, started_cpu = time.perf_counter(), time.thread_time()
            collector.schedule_collection()
            scheduled, scheduled_cpu = time.perf_counter(), time.thread_time()
            torch.cuda._sleep(50_000_000)  # ~30 ms of training work queued after the window
            collector.collect_results()
            done = time.perf_counter()
            overlapped += not torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            if window >= 5:  # the first windows warm up (allocator, NCCL)
                schedule.append(scheduled - started)
                schedule_cpu.append(scheduled_cpu - started_cpu)
                latency.append(done - started)
                worker_cpu += time.clock_gettime(clock) - worker_started
    return {
        "schedule_us": _median_us(schedule),
        "schedule_cpu_us": _median_us(schedule_cpu),
        "worker_cpu_us": worker_cpu / windows * 1e6,
        "latency_us": _median_us(latency),
        "overlap": overlapped / (windows + 5),
    }


def _host_syncs_per_step(steps: int) -> tuple[float, float]:
    """Host syncs per `Telemetry.step()` in steady state: the CUDA driver's count, and NoHostSync's."""
    metrics = {"loss": tt.WeightedMeanMetric(), "tokens": tt.SumMetric(kind="counter")}
    metrics = {name: metric.to("cuda") for name, metric in metrics.items()}
    telemetry = tt.Telemetry(metrics, every=10)
    tokens = torch.tensor(512, device="cuda")
    try:
        for step in range(20):
            telemetry.step(step, tokens=tokens, learning_rate=1e-3)
        telemetry.flush()
        detector = NoHostSync(collect=True)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(20, 20 + steps):
                    metrics["loss"].update(torch.ones((), device="cuda"), tokens)
                    with detector:
                        telemetry.step(step, tokens=tokens, learning_rate=1e-3)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        driver = sum("synchroniz" in str(warning.message) for warning in caught)
    finally:
        telemetry.close()
    return driver / steps, len(detector.seen) / steps


def _run_tests(outcomes: _Outcomes, collect_only: bool) -> None:
    arguments = ["-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"]
    pytest.main([*arguments, "--collect-only"] if collect_only else arguments, plugins=[outcomes])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--updates", type=int, default=20000)
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
    update_us, floor_us = _update_figures(args.updates)
    with nccl_world_of_one():
        figures = [(t, k, _window_figures(k, t, args.windows)) for t in ("host", "device") for k in _SIZES]
    driver_syncs, dispatch_syncs = _host_syncs_per_step(100)
    failed = [test for test, outcome in outcomes.rows.items() if outcome == "failed"]
    print(f"\ntorch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    print("| check | result |")
    print("|---|---|")
    print(
        f"| cuda tests | {outcomes.count('passed')} passed, {len(failed)} failed, "
        f"{outcomes.count('skipped')} skipped |"
    )
    for test in failed:
        print(f"| failed | {test} |")
    for module in outcomes.import_errors:
        print(f"| import error | {module} |")
    print(
        f"| update() of a 0-d weighted mean | {update_us:.2f} µs vs floor {floor_us:.2f} µs "
        f"({update_us / floor_us:.2f}x) |"
    )
    syncs = f"{driver_syncs:g} (CUDA driver), {dispatch_syncs:g} (NoHostSync)"
    print(f"| host syncs per Telemetry.step() | {syncs} |")
    for transport, k, row in figures:
        print(
            f"| {transport} transport, K = {k} | schedule_collection() {row['schedule_us']:.0f} µs wall, "
            f"{row['schedule_cpu_us']:.0f} µs CPU on the training thread; worker "
            f"{row['worker_cpu_us']:.0f} µs CPU/window; schedule to Python {row['latency_us']:.0f} µs; "
            f"overlap {row['overlap']:.0%} |"
        )
    sys.exit(1 if failed or outcomes.import_errors or not outcomes.rows else 0)


if __name__ == "__main__":
    main()
