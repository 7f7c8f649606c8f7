"""What one window costs once scheduled: sync + compute to Python values, against a hand-written floor.

Run from the repository root (real gloo ranks on this machine's CPUs):

    .venv/bin/python -m bench.bench_window [--world-sizes 2,4] [--windows 200] [--rounds 5]

Metrics cycle weighted mean / sum / max / min (K of them). Per world size, on rank 0:

1. **sync + compute to Python of 128 mixed metrics**: µs per call and collectives per call
   (steady state, counted by wrapping the collectives) for
   - the floor: the same states in plain tensors, one `torch.cat` per reduce op, one packed
     `all_reduce` per op (2), the means by one division of two index-selected slices, one
     `tolist()` per buffer;
   - `tt.sync_and_compute(tree)` (one packed slot, one collective, batched compute, one host
     tensor);
   - the path before it: `tt.sync_metrics(tree)` + each metric's `compute()` + `to_python`.
2. **the worker's window** for K = 1, 16, 128: CPU time the collector's worker thread spends per
   window (its thread clock over `--windows` windows, host transport), next to the floor's CPU
   time for the same reduce + compute + `tolist()` on the calling thread; and torch ops
   dispatched per window (a `TorchDispatchMode`) by the batched path (`sync_and_compute`, the
   code the worker runs) and by the floor.

Rounds interleave the contestants; the fastest round is kept (the machine is shared).
"""

from __future__ import annotations

import argparse
import platform
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from tests.distributed import run_ranks
from tests.ops import OpCounter
from tests.sync.collectives import CollectiveCounter

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.report import to_python

_KINDS = ("mean", "sum", "max", "min")
_SIZES = (1, 16, 128)


def _kinds(count: int) -> list[str]:
    return [_KINDS[i % len(_KINDS)] for i in range(count)]


class Floor:
    """Plain float64 states; per window: cat per op, one all_reduce per op, one division, tolists."""

    def __init__(self, kinds: list[str], rank: int) -> None:
        means = sum(k == "mean" for k in kinds)
        # Weighted sum and weight of every mean first (interleaved), then the sums; max and -min.
        self.sums = [torch.tensor(float(rank + i)) for i in range(2 * means)]
        self.sums += [torch.tensor(float(rank + i)) for i, k in enumerate(kinds) if k == "sum"]
        self.maxes = [torch.tensor(float(rank + i)) for i, k in enumerate(kinds) if k in ("max", "min")]
        self.numerators = torch.arange(0, 2 * means, 2)
        self.denominators = self.numerators + 1
        self.others = torch.arange(2 * means, len(self.sums))

    def window(self) -> list[list[float]]:
        results = []
        if self.sums:
            sums = torch.cat([s.reshape(1) for s in self.sums])
            dist.all_reduce(sums)
            results.append((sums[self.numerators] / sums[self.denominators]).tolist())
            results.append(sums[self.others].tolist())
        if self.maxes:
            maxes = torch.cat([s.reshape(1) for s in self.maxes])
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            results.append(maxes.tolist())
        return results


def _metrics(kinds: list[str], rank: int) -> dict[str, tt.Metric]:
    make = {"mean": tt.WeightedMeanMetric, "sum": tt.SumMetric, "max": tt.MaxMetric, "min": tt.MinMetric}
    metrics = {f"m{i:03d}": make[k]() for i, k in enumerate(kinds)}
    for i, metric in enumerate(metrics.values()):
        metric.update(torch.tensor(float(rank + i)))
    return metrics


def _previous_path(metrics: dict[str, tt.Metric]) -> Any:
    tt.sync_metrics(metrics)
    return {name: to_python(metric.compute()) for name, metric in metrics.items()}


def _timed(fn: Any, calls: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def _count(fn: Any, counter: CollectiveCounter) -> int:
    fn()
    fn()
    with counter.counting() as calls:
        fn()
    return sum(calls.values())


def _worker_cpu_us(metrics: dict[str, tt.Metric], windows: int) -> float:
    """CPU time of the collector's worker thread per window (host transport, one window in flight)."""
    with AsyncMetricCollector(metrics, transport="host") as collector:
        for _ in range(3):
            collector.schedule_collection()
            collector.collect_results()
        worker = next(t for t in threading.enumerate() if t.name.startswith("torchtelemetry-collector"))
        clock = time.pthread_getcpuclockid(worker.ident)  # type: ignore[arg-type]
        dist.barrier()
        started = time.clock_gettime(clock)
        for _ in range(windows):
            collector.schedule_collection()
            collector.collect_results()
        return (time.clock_gettime(clock) - started) / windows * 1e6


def _floor_cpu_us(floor: Floor, windows: int) -> float:
    dist.barrier()
    started = time.thread_time()
    for _ in range(windows):
        floor.window()
    return (time.thread_time() - started) / windows * 1e6


def _ops(fn: Any) -> int:
    fn()
    with OpCounter() as ops:
        fn()
    return sum(ops.ops.values())


def _bench_rank(rank: int, world_size: int, windows: int, rounds: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counter = CollectiveCounter()
    kinds = _kinds(128)
    metrics = _metrics(kinds, rank)
    floor = Floor(kinds, rank)
    contestants = {
        "floor": floor.window,
        "sync_and_compute": lambda: tt.sync_and_compute(metrics),
        "sync_metrics + compute() + to_python": lambda: _previous_path(metrics),
    }
    sync = {name: [float("inf"), _count(fn, counter)] for name, fn in contestants.items()}
    per_k: dict[int, dict[str, Any]] = {}
    for k in _SIZES:
        k_metrics, k_floor = _metrics(_kinds(k), rank), Floor(_kinds(k), rank)
        per_k[k] = {
            "worker_us": float("inf"),
            "floor_us": float("inf"),
            "ops": _ops(lambda m=k_metrics: tt.sync_and_compute(m)),
            "floor_ops": _ops(k_floor.window),
            "metrics": k_metrics,
            "floor": k_floor,
        }
    for _ in range(rounds):
        for name, fn in contestants.items():
            sync[name][0] = min(sync[name][0], _timed(fn, windows))
        for row in per_k.values():
            row["worker_us"] = min(row["worker_us"], _worker_cpu_us(row["metrics"], windows))
            row["floor_us"] = min(row["floor_us"], _floor_cpu_us(row["floor"], windows))
    for row in per_k.values():
        del row["metrics"], row["floor"]
    return {"sync": sync, "per_k": per_k}


def _report(world_size: int, result: dict[str, Any]) -> str:
    floor_us = result["sync"]["floor"][0]
    lines = [
        f"world size {world_size}: sync + compute to Python, 128 mixed metrics | µs | vs floor | collectives",
        "|---|---|---|---|",
    ]
    for name, (micros, collectives) in result["sync"].items():
        lines.append(f"| {name} | {micros:.0f} | {micros / floor_us:.2f}x | {collectives} |")
    lines += [
        "",
        f"world size {world_size}: one window | worker CPU µs | floor CPU µs | ratio | ops (batched) "
        "| ops (floor) |",
        "|---|---|---|---|---|---|",
    ]
    for k, row in result["per_k"].items():
        lines.append(
            f"| K = {k} | {row['worker_us']:.0f} | {row['floor_us']:.0f} | "
            f"{row['worker_us'] / row['floor_us']:.2f}x | {row['ops']} | {row['floor_ops']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, gloo")
    for world_size in map(int, args.world_sizes.split(",")):
        per_rank = run_ranks(_bench_rank, world_size, args.windows, args.rounds, timeout_s=3600)
        print(_report(world_size, per_rank[0]))
        print()


if __name__ == "__main__":
    main()
