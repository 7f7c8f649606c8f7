"""What each process-global cache buys: the same call with the cache kept and emptied before each call.

Run from the repository root (real gloo ranks on this machine's CPUs):

    .venv/bin/python -m bench.bench_state [--world-size 2] [--metrics 128] [--calls 100] [--rounds 5]

Each cache is documented in docs/collection.md ("State"). On rank 0, µs and collectives per call
for a tree of `--metrics` mixed built-in metrics (weighted mean / sum / max / min), with the cache
and with it emptied before every call (every rank empties it at the same point, so the
collectives match):

- `_SYNC_VIEWS` (metric/_sync.py): `tt.sync_metrics(tree)` reuses the bucket layout and flat views of
  the tree's accumulators;
- `_PREPARED` (collect/_blocking.py): `tt.sync_and_compute(tree)` reuses the window plan, the
  exchange and the packed slot;
- `_VERIFIED_LAYOUTS` (sync/_reduce.py): a layout's agreement across the ranks is checked once per
  group (one blocking collective) instead of at every `sync_metrics` / `sync_and_compute` /
  `reduce` call.

Rounds interleave the contestants; the fastest round is kept (the machine is shared).
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tests.distributed import run_ranks
from tests.sync.collectives import CollectiveCounter

import torchtelemetry as tt
from torchtelemetry.collect import _blocking
from torchtelemetry.metric import _sync
from torchtelemetry.sync import _reduce

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)


def _metrics(count: int, rank: int) -> dict[str, tt.Metric]:
    metrics: dict[str, tt.Metric] = {f"m{i:03d}": _KINDS[i % len(_KINDS)]() for i in range(count)}
    for i, metric in enumerate(metrics.values()):
        metric.update(torch.tensor(float(rank + i)))
    return metrics


def _timed(fn: Callable[[], Any], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _emptied(cache: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        cache.clear()
        return fn()

    return call


def _collectives(fn: Callable[[], Any], counter: CollectiveCounter) -> int:
    fn()
    with counter.counting() as calls:
        fn()
    return sum(calls.values())


def _bench_rank(rank: int, world_size: int, count: int, calls: int, rounds: int) -> dict[str, list[float]]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counter = CollectiveCounter()
    metrics = _metrics(count, rank)
    sync = lambda: tt.sync_metrics(metrics)  # noqa: E731
    blocking = lambda: tt.sync_and_compute(metrics)  # noqa: E731
    contestants = {
        "sync_metrics, _SYNC_VIEWS kept": sync,
        "sync_metrics, _SYNC_VIEWS emptied": _emptied(_sync._SYNC_VIEWS, sync),
        "sync_and_compute, _PREPARED kept": blocking,
        "sync_and_compute, _PREPARED emptied": _emptied(_blocking._PREPARED, blocking),
        "sync_metrics, _VERIFIED_LAYOUTS kept": sync,
        "sync_metrics, _VERIFIED_LAYOUTS emptied": _emptied(_reduce._VERIFIED_LAYOUTS, sync),
    }
    best = {name: [float("inf"), _collectives(fn, counter)] for name, fn in contestants.items()}
    for _ in range(rounds):
        for name, fn in contestants.items():
            best[name][0] = min(best[name][0], _timed(fn, calls))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--metrics", type=int, default=128)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, gloo")
    best = run_ranks(_bench_rank, args.world_size, args.metrics, args.calls, args.rounds, timeout_s=3600)[0]
    title = f"world size {args.world_size}, {args.metrics} metrics"
    print(f"| {title} | µs per call | emptied / kept | collectives |")
    print("|---|---|---|---|")
    names = list(best)
    for kept, emptied in zip(names[::2], names[1::2], strict=True):
        (kept_us, kept_calls), (emptied_us, emptied_calls) = best[kept], best[emptied]
        print(f"| {kept} | {kept_us:.0f} | | {kept_calls} |")
        print(f"| {emptied} | {emptied_us:.0f} | {emptied_us / kept_us:.2f}x | {emptied_calls} |")


if __name__ == "__main__":
    main()
