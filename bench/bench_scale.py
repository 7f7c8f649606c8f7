"""Many ranks: what one window costs each rank as the world grows, measured against the cost model.

Run from the repository root (slow: every rank is a process on this machine's cores; the counts
are exact, the times are those of an oversubscribed machine):

    .venv/bin/python -m bench.bench_scale [--world-sizes 8,16,32] [--metrics 16,1024] [--windows 20]

Every rank binds an `AsyncMetricCollector` to what `Telemetry` binds: a tree of `--metrics`
metrics (weighted mean / sum / max / min, cycling: two buckets, SUM and MAX) plus the built-in
signals' metrics (step time, data wait and data-wait share per rank, tokens, samples, learning
rate, peak memory), over the world's gloo group. After warm-up windows (the first checks the
layout), each measured window updates every metric once, then rank by rank:

- **collectives**: torch.distributed collectives issued per window (`tests.sync.collectives`);
- **bytes sent**: what the process wrote to its sockets per window (`/proc/self/io` `wchar`: gloo
  writes each message with a 48-byte header, so the payload is `wchar - 48 x writes`), and the
  write calls (`syscw`: gloo's TCP ring makes 6 per ring step);
- **schedule**: the training thread's time in `schedule_collection()` (wall and thread CPU), median.

Each row is set against `torchtelemetry.sync.window_cost` (docs/scale.md): collectives, ring
steps and payload bytes predicted from the window's layout alone.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
from tests.distributed import run_ranks
from tests.sync.collectives import GLOO_HEADER_BYTES, CollectiveCounter, measure_traffic

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector, WindowPlan
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import SignalContext, SignalSet, builtin_signals
from torchtelemetry.sync import window_cost

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
GLOO_WRITES_PER_RING_STEP = 6
"""Write calls per ring step of gloo's TCP all-reduce (measured with 2-32 ranks, torch 2.13)."""


def bound_metrics(count: int, world_size: int, rank: int) -> tuple[dict[str, Any], SignalSet]:
    """What `Telemetry` binds for a tree of `count` metrics: the tree and the signals' metrics."""
    tree = {f"m{i:04d}": _KINDS[i % len(_KINDS)]() for i in range(count)}
    signals = SignalSet(builtin_signals(SignalContext(world_size, rank, torch.device("cpu"))))
    return {"tree": tree, **signals.metrics()}, signals


def fill(metrics: dict[str, Any], signals: SignalSet, rank: int) -> None:
    """One update of every metric of the tree, and one window of signals."""
    value = torch.tensor(float(rank + 1))
    for metric in metrics["tree"].values():
        metric.update(value)
    signals.record_step(0, 0.1 * (rank + 1), {"tokens": 1024, "data_time": 0.01})
    signals.flush(1.0)


def _measure(rank: int, world_size: int, count: int, windows: int, counter: CollectiveCounter) -> dict:
    metrics, signals = bound_metrics(count, world_size, rank)
    schedule_s, schedule_cpu_s = [], []
    with AsyncMetricCollector(metrics, timeout_s=900, max_pending=2) as collector:

        def window() -> None:
            fill(metrics, signals, rank)
            started, started_cpu = time.perf_counter(), time.thread_time()
            collector.schedule_collection()
            schedule_s.append(time.perf_counter() - started)
            schedule_cpu_s.append(time.thread_time() - started_cpu)
            collector.collect_results()

        for _ in range(2):  # the first window also checks the layout
            window()
        del schedule_s[:], schedule_cpu_s[:]
        traffic = measure_traffic(counter, window, windows)
    return {
        "collectives": traffic.collectives,
        "writes": traffic.writes,
        "payload": traffic.payload,
        "wchar": traffic.payload + GLOO_HEADER_BYTES * traffic.writes,
        "schedule_us": statistics.median(schedule_s) * 1e6,
        "schedule_cpu_us": statistics.median(schedule_cpu_s) * 1e6,
    }


def _bench_rank(rank: int, world_size: int, counts: list[int], windows: int) -> dict[int, dict]:
    counter = CollectiveCounter()
    return {count: _measure(rank, world_size, count, windows, counter) for count in counts}


def predicted(count: int, world_size: int) -> dict[str, Any]:
    """The cost model's figures for a window of `count` metrics plus the signals at `world_size` ranks."""
    metrics, _ = bound_metrics(count, world_size, 0)
    layout = WindowPlan(metric_leaves(metrics, op="bench_scale"), world_size).layout
    cost = window_cost(layout, world_size)
    return {"cost": cost, "buckets": len(layout.buckets)}


def _report(world_size: int, per_rank: list[dict[int, dict]]) -> list[str]:
    lines = []
    for count in per_rank[0]:
        model = predicted(count, world_size)
        cost = model["cost"]
        rows = [ranks[count] for ranks in per_rank]

        def spread(key: str, rows: list[dict] = rows) -> str:
            low, high = min(r[key] for r in rows), max(r[key] for r in rows)
            return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"

        lines.append(
            f"| {world_size} | {count} | {'gathered' if cost.collectives == 1 else 'per bucket'} "
            f"| {spread('collectives')} / {cost.collectives} "
            f"| {spread('writes')} / {GLOO_WRITES_PER_RING_STEP * cost.ring_steps} "
            f"| {spread('payload')} / {cost.bytes_sent:.0f} | {spread('wchar')} "
            f"| {rows[0]['schedule_us']:.0f} ({spread('schedule_us')}) "
            f"| {rows[0]['schedule_cpu_us']:.0f} ({spread('schedule_cpu_us')}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="8,16,32")
    parser.add_argument("--metrics", default="16,1024")
    parser.add_argument("--windows", type=int, default=20)
    args = parser.parse_args()
    counts = [int(count) for count in args.metrics.split(",")]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, gloo")
    print(
        "| ranks | metrics | window | collectives (measured / model) | write calls (measured / model) "
        "| payload bytes sent (measured / model) | bytes written | schedule wall µs, rank 0 (all ranks) "
        "| schedule CPU µs, rank 0 (all ranks) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for world_size in map(int, args.world_sizes.split(",")):
        started = time.monotonic()
        per_rank = run_ranks(_bench_rank, world_size, counts, args.windows, timeout_s=3600, pg_timeout_s=900)
        print("\n".join(_report(world_size, per_rank)), f"<!-- {time.monotonic() - started:.0f} s -->")


if __name__ == "__main__":
    main()
