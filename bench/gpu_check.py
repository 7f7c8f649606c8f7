"""`make gpu-check`: the `cuda`-marked tests and the GPU collection benchmark, as one table.

Run from the repository root on a machine with a CUDA device:

    .venv/bin/python -m bench.gpu_check [--windows 200]

1. Runs `pytest -m cuda tests/` in this process and records each test's outcome.
2. Benchmarks collection on the GPU, in a 1-rank NCCL process group (so the device transport
   issues a real NCCL collective and the host transport a real gloo one), for K = 1, 16 and 128
   metrics cycling weighted mean / sum / max / min, per transport: the training thread's time
   inside `schedule_collection()` (median, wall and thread CPU), the worker thread's CPU time
   per window, and the latency from schedule to results in Python (median).
3. Prints one Markdown table; exits 1 if a test failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import pytest
import torch
from tests.distributed import nccl_world_of_one

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
_SIZES = (1, 16, 128)


class _Outcomes:
    """A pytest plugin keeping each test's outcome (the call phase, or the failing/skipping phase)."""

    def __init__(self) -> None:
        self.rows: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.rows[report.nodeid] = report.outcome


def _window_figures(k: int, transport: str, windows: int) -> dict[str, float]:
    metrics = {f"m{i:03d}": _KINDS[i % len(_KINDS)]() for i in range(k)}
    value = torch.tensor(1.5, device="cuda")
    schedule, schedule_cpu, latency = [], [], []
    with AsyncMetricCollector(metrics, device="cuda", transport=transport, timeout_s=60) as collector:  # type: ignore[arg-type]
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
            collector.collect_results()
            done = time.perf_counter()
            if window >= 5:  # the first windows warm up (layout check, pinned buffers)
                schedule.append(scheduled - started)
                schedule_cpu.append(scheduled_cpu - started_cpu)
                latency.append(done - started)
                worker_cpu += time.clock_gettime(clock) - worker_started
    return {
        "schedule_us": statistics.median(schedule) * 1e6,
        "schedule_cpu_us": statistics.median(schedule_cpu) * 1e6,
        "worker_cpu_us": worker_cpu / windows * 1e6,
        "latency_us": statistics.median(latency) * 1e6,
    }


def _benchmark(windows: int) -> list[tuple[str, int, dict[str, float]]]:
    with nccl_world_of_one():
        return [
            (transport, k, _window_figures(k, transport, windows))
            for transport in ("host", "device")
            for k in _SIZES
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA device; none is visible (torch.cuda.is_available() is False)")
        sys.exit(2)
    outcomes = _Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"], plugins=[outcomes])
    figures = _benchmark(args.windows)
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}, 1-rank NCCL group")
    print("| check | result |")
    print("|---|---|")
    for test, outcome in outcomes.rows.items():
        print(f"| {test} | {outcome} |")
    for transport, k, row in figures:
        print(
            f"| {transport} transport, K = {k} | schedule_collection {row['schedule_us']:.0f} µs wall, "
            f"{row['schedule_cpu_us']:.0f} µs CPU; worker {row['worker_cpu_us']:.0f} µs CPU/window; "
            f"schedule to Python {row['latency_us']:.0f} µs |"
        )
    failed = [test for test, outcome in outcomes.rows.items() if outcome == "failed"]
    sys.exit(1 if failed or not outcomes.rows else 0)


if __name__ == "__main__":
    main()
