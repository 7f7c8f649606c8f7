"""What `progress_file` costs `Telemetry.step()`, on a healthy and on a hung file system.

    PYTHONPATH=src .venv/bin/python -m bench.bench_progress [--steps 400] [--rounds 3]

One process, `Telemetry(every=1)` (a window, hence a progress write, every step) over one metric and
the built-in signals; a training step is a CPU matmul chain of ~1 ms. Three setups, interleaved
round by round: no `progress_file`; a `progress_file` in a temporary directory; a `progress_file`
whose writes hang (the `.partial` is opened on a FIFO nobody reads, as a hung NFS mount would hold
the open). The figure is the median µs of one `step()` call, and its ratio to the run without a
progress file (the target: within 2x on the hung file system).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import torchtelemetry as tt


def _median_step_us(steps: int, progress: Path | None, hung_fifo: Path | None) -> float:
    metrics = {"loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, every=1, run_id="bench", progress_file=progress)
    if hung_fifo is not None and telemetry._progress is not None:
        telemetry._progress.file._opener = lambda name, flags: os.open(hung_fifo, os.O_WRONLY)
    work, value, times = torch.randn(128, 128), torch.tensor(1.0), []
    try:
        for step in range(steps):
            for _ in range(4):
                work = torch.tanh(work @ work)
            metrics["loss"].update(value, 1)
            started = time.perf_counter()
            telemetry.step(step)
            times.append(time.perf_counter() - started)
    finally:
        if hung_fifo is not None:  # let the hung write go, so close() need not wait for it
            reader = os.open(hung_fifo, os.O_RDONLY | os.O_NONBLOCK)
        telemetry.close()
        if hung_fifo is not None:
            os.close(reader)
    return statistics.median(times[steps // 10 :]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, list[float]] = {"none": [], "file": [], "hung": []}
    with tempfile.TemporaryDirectory() as directory:
        fifo = Path(directory) / "hung"
        os.mkfifo(fifo)
        for round_ in range(args.rounds):
            figures["none"].append(_median_step_us(args.steps, None, None))
            figures["file"].append(_median_step_us(args.steps, Path(directory) / f"p{round_}.json", None))
            figures["hung"].append(_median_step_us(args.steps, Path(directory) / f"h{round_}.json", fifo))
    base = min(figures["none"])
    print("| progress_file | step() median (µs) | vs none |")
    print("|---|---|---|")
    for name, values in figures.items():
        print(f"| {name} | {min(values):.1f} | {min(values) / base:.2f}x |")


if __name__ == "__main__":
    main()
