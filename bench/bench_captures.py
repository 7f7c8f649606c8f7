"""Captures: what they cost the training thread between captures, how long from a verdict to the
files on disk, and how large a capture is.

    PYTHONPATH=src .venv/bin/python -m bench.bench_captures     # --steps 2000 --rounds 21 --every 10

- **between captures** (`--cost-only` for this part alone): one process, no model, as
  `bench_health.py`: each step updates a 0-d loss and calls `telemetry.step()` (a collection every
  `--every` steps), with captures on (the default `capture_on`) and off (`capture_on=()`, twice: the
  second is the control, whose ratio to the first is the noise), every other setting the same. The
  training thread's own CPU time per step (`time.thread_time`), variants rotated round by round;
  each round's ratio to "off", its median and quartiles (single rounds swing on a shared host), and
  the captures' own calls timed alone.
- **verdict to files, size** (`--latency-only`): three gloo ranks train a 3-layer MLP (256 wide,
  batch 64) under DDP with `watch_gradient_sync`, rank 2 sleeping 0.25 s a step in its forward,
  `every=10` and `capture_steps=5` (the defaults); from the exporting rank's JSONL lines, the window
  whose `train/straggler/top_rank` first names rank 2 (its step and schedule time) against the
  capture's start step and the time its `trace.json` reached the disk (its mtime); the size of each
  file of the capture and of its reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tests.distributed import run_ranks
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt

STEP_S = 6.6e-3
"""The CPU step the 1 % budget is taken of (bench_health.py's)."""
DELAY_S = 0.25
STEPS = 100


def _loop(telemetry: tt.Telemetry) -> Callable[[int], None]:
    loss_metric = telemetry.metrics["train"]["loss"]
    loss, tokens = torch.tensor(2.5), torch.tensor(512)

    def run(steps: int) -> None:
        for step in range(steps):
            loss_metric.update(loss, tokens)
            telemetry.step(step, tokens=tokens)

    return run


def _cost(steps: int, rounds: int, every: int) -> None:
    torch.set_num_threads(1)
    variants = {"off": {"capture_on": ()}, "off again (control)": {"capture_on": ()}, "on": {}}
    telemetries = {
        name: tt.Telemetry(
            {"train": {"loss": tt.WeightedMeanMetric()}}, [], every=every, nvml=False, **fields
        )
        for name, fields in variants.items()
    }
    loops = {name: _loop(telemetry) for name, telemetry in telemetries.items()}
    for run in loops.values():
        run(steps // 10)  # warm-up
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for round_ in range(rounds):
        for name in names[round_ % 3 :] + names[: round_ % 3]:  # each variant first as often
            start = time.thread_time()  # this thread's CPU: not the worker's, nor waits for the GIL
            loops[name](steps)
            per_step[name].append((time.thread_time() - start) / steps)
    pieces = _pieces(telemetries["on"])
    for telemetry in telemetries.values():
        telemetry.close()
    print(f"machine: {_machine()}")
    print(f"{steps} steps x {rounds} rounds, order rotated, a collection every {every} steps")
    print("| variant | thread CPU µs per step (median) | / off per round: median | quartiles |")
    print("|---|---|---|---|")
    off = per_step["off"]
    for name, seconds in per_step.items():
        ratios = sorted(value / base for value, base in zip(seconds, off, strict=True))
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"| captures {name} | {1e6 * statistics.median(seconds):.1f} | "
            f"{statistics.median(ratios):.3f}x | {low:.3f}x - {high:.3f}x |"
        )
    added = statistics.median(per_step["on"]) - statistics.median(off)
    print(f"added per step (medians): {1e6 * added:+.2f} µs = {100 * added / STEP_S:+.3f} % of a 6.6 ms step")
    print(
        "the captures' own calls (timeit, fastest of 5): "
        + ", ".join(f"{name} {1e6 * seconds:.3f} µs" for name, seconds in pieces.items())
        + f"; per step at every={every}: {1e6 * (pieces['step'] + pieces['window'] / every):.3f} µs"
    )


def _pieces(telemetry: tt.Telemetry) -> dict[str, float]:
    """The captures' own training-thread work between captures: the per-step check, and a window's
    staging (its flush and host value)."""
    (captures,) = [signal for signal in telemetry._signals.signals if signal.name == "captures"]

    def window() -> None:
        captures.flush(0.0)
        captures.host_values()

    def best(call: Callable[[], object]) -> float:
        return min(timeit.repeat(call, number=20_000, repeat=5)) / 20_000

    return {"step": best(lambda: captures.on_step(1, None)), "window": best(window)}


def _straggle(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.JsonlExporter(Path(directory) / "metrics.jsonl")],
        run_id="bench",
        dump_dir=directory,
        max_captures=1,
        nvml=False,
    )
    telemetry.watch_gradient_sync(model)
    for step in range(STEPS):
        with telemetry.phase("forward"):
            loss = model(torch.randn(64, 256)).pow(2).mean()
            if rank == 2:
                time.sleep(DELAY_S)
        with telemetry.phase("backward"):
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        loss_metric.update(loss.detach(), 64)
        telemetry.step(step)
    telemetry.close()
    return {}


def _latency() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-captures-") as directory:
        run_ranks(_straggle, 3, directory, timeout_s=900)
        lines = [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]
        verdict = next(
            line for line in lines if 2.0 in line["values"].get("train/straggler/top_rank", {}).values()
        )
        captures = sorted(Path(directory).glob("torchtelemetry-capture-*"))
        print(f"machine: {_machine()}")
        print(
            f"3 ranks, rank 2 sleeping {DELAY_S} s a step in its forward; defaults: every=10, max_pending=2,"
        )
        print("capture_steps=5")
        for capture in captures:
            sizes = ", ".join(
                f"{path.name} {path.stat().st_size / 1e3:,.1f} kB" for path in sorted(capture.iterdir())
            )
            print(f"  {capture.name}: {sizes}")
        named = next(capture for capture in captures if capture.name.endswith("-straggler"))
        begun = int(named.name.split("-step")[1].split("-")[0])
        written = (named / "trace.json").stat().st_mtime
        print(
            f"verdict: the window ending at step {verdict['step']} (scheduled at t=0); the capture began "
            f"after step {begun} ({begun - verdict['step']} steps later) and its trace.json was on disk at "
            f"t={written - verdict['timestamp']:.1f} s"
        )


def _machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--cost-only", action="store_true")
    parser.add_argument("--latency-only", action="store_true")
    args = parser.parse_args()
    if not args.latency_only:
        _cost(args.steps, args.rounds, args.every)
    if not args.cost_only:
        _latency()


if __name__ == "__main__":
    main()
