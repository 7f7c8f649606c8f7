"""What `Telemetry.step()` costs the training thread as the number of metrics grows, in one process.

    PYTHONPATH=src .venv/bin/python -m bench.bench_step [--metrics 100,1000,10000] [--windows 40]

A loop of training steps (a CPU matmul of ~2 ms standing in for the step's work; it releases the
GIL, as waiting for a GPU does) with `Telemetry(every=10)` over N metrics (weighted mean / sum /
max / min cycling, one updated per step) and the built-in signals. Per N: the training thread's
time inside `step()` per window (wall and thread CPU, summed over the window's 10 calls; median
over windows after 5 warm-up windows), and its ratio to the smallest N. Figures go to
bench/README.md; the ratio is what the target is about (10,000 metrics within 2x of 100).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torchtelemetry as tt

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
EVERY = 10


def _per_window(num_metrics: int, windows: int) -> tuple[float, float]:
    """Median µs of `step()` per window on the training thread: (wall, thread CPU)."""
    metrics = {f"layer{i % 100}/metric{i}": _KINDS[i % len(_KINDS)]() for i in range(num_metrics)}
    telemetry = tt.Telemetry(metrics, every=EVERY)
    work = torch.randn(256, 256)
    value = torch.tensor(1.0)
    walls, cpus = [], []
    try:
        for window in range(windows + 5):
            wall = cpu = 0.0
            for step in range(window * EVERY, (window + 1) * EVERY):
                for _ in range(8):
                    work = torch.tanh(work @ work)  # the training step's own work (GIL released)
                metrics[f"layer{step % 100}/metric{step % num_metrics}"].update(value)
                started, started_cpu = time.perf_counter(), time.thread_time()
                telemetry.step(step, tokens=512)
                wall += time.perf_counter() - started
                cpu += time.thread_time() - started_cpu
            if window >= 5:
                walls.append(wall)
                cpus.append(cpu)
    finally:
        telemetry.close()
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", default="100,1000,10000", help="comma-separated numbers of metrics")
    parser.add_argument("--windows", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(size) for size in args.metrics.split(",")]
    figures = {size: _per_window(size, args.windows) for size in sizes}
    base_wall, base_cpu = figures[sizes[0]]
    print(f"| metrics | step() per window, wall (µs) | vs {sizes[0]} | thread CPU (µs) | vs {sizes[0]} |")
    print("|---|---|---|---|---|")
    for size, (wall, cpu) in figures.items():
        print(f"| {size:,} | {wall:.0f} | {wall / base_wall:.2f}x | {cpu:.0f} | {cpu / base_cpu:.2f}x |")


if __name__ == "__main__":
    main()
