"""Update and sync cost of torchtelemetry vs torchmetrics, torcheval and a hand-written floor.

Run from the repository root (2 gloo ranks on this machine's CPUs):

    .venv/bin/python -m bench.bench_sync [--updates 20000] [--syncs 200]

Per library it measures, on rank 0 of a real 2-rank gloo group:
  * microseconds per `update(loss, n_tokens)` of a weighted mean (0-d float32 loss,
    0-d int64 token count, as a training step produces them);
  * microseconds per sync of K weighted means (K = 1, 16, 128), and of 128 mixed
    metrics (weighted mean / sum / max / min), with the number of torch.distributed
    collectives one sync issues (counted by wrapping the collectives, outermost call only).

The floor keeps the same states in plain tensors updated with `add_` and syncs them with
one `torch.cat` + one packed `all_reduce` per reduce op (1 for means, 2 for the mixed set).
Figures are printed as a Markdown table with ratios to the floor.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from tests.distributed import run_ranks
from tests.sync.collectives import CollectiveCounter

_SYNC_SIZES = (1, 16, 128)
_KINDS = ("mean", "sum", "max", "min")


# -- the three contestants and the floor ------------------------------------------------------


class Floor:
    """Plain tensors updated with add_; one packed all_reduce per reduce op."""

    def __init__(self, kinds: list[str]) -> None:
        start = {"mean": 0.0, "sum": 0.0, "max": float("-inf"), "min": float("inf")}
        # A weighted mean holds two states (weighted sum, total weight).
        self.states = [
            (kind, torch.full((), start[kind], dtype=torch.float64))
            for kind in kinds
            for _ in range(2 if kind == "mean" else 1)
        ]
        self.synced: list[torch.Tensor] = []

    def update_mean(self, loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.states[0][1].add_(loss * n_tokens)
        self.states[1][1].add_(n_tokens)

    def fill(self, rank: int) -> None:
        for i, (_, state) in enumerate(self.states):
            state.add_(float(rank + i))

    def sync(self) -> None:
        sums = [s.reshape(1) for k, s in self.states if k in ("mean", "sum")]
        maxes = [
            s.reshape(1) if k == "max" else s.neg().reshape(1) for k, s in self.states if k in ("max", "min")
        ]
        synced = []
        for parts, op in ((sums, dist.ReduceOp.SUM), (maxes, dist.ReduceOp.MAX)):
            if parts:
                buffer = torch.cat(parts)
                dist.all_reduce(buffer, op=op)
                synced.extend(buffer.unbind())
        self.synced = synced


class Telemetry:
    def __init__(self, kinds: list[str]) -> None:
        import torchtelemetry as tt

        make = {"mean": tt.WeightedMeanMetric, "sum": tt.SumMetric, "max": tt.MaxMetric, "min": tt.MinMetric}
        self.metrics = {f"m{i}": make[k]() for i, k in enumerate(kinds)}
        self._sync = functools.partial(tt.sync_metrics, self.metrics)

    def update_mean(self, loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.metrics["m0"].update(loss, n_tokens)

    def fill(self, rank: int) -> None:
        for i, metric in enumerate(self.metrics.values()):
            metric.update(torch.tensor(float(rank + i)))

    def sync(self) -> None:
        self._sync()


class TorchMetrics:
    def __init__(self, kinds: list[str]) -> None:
        import torchmetrics

        make = {
            "mean": torchmetrics.MeanMetric,
            "sum": torchmetrics.SumMetric,
            "max": torchmetrics.MaxMetric,
            "min": torchmetrics.MinMetric,
        }
        self.metrics = [make[k]() for k in kinds]

    def update_mean(self, loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.metrics[0].update(loss, n_tokens)

    def fill(self, rank: int) -> None:
        for i, metric in enumerate(self.metrics):
            metric.update(torch.tensor(float(rank + i)))

    def sync(self) -> None:
        for metric in self.metrics:
            metric.sync()

    def after_sync(self) -> None:
        for metric in self.metrics:
            metric.unsync()


class TorchEval:
    def __init__(self, kinds: list[str]) -> None:
        import torcheval.metrics as tm

        make = {"mean": tm.Mean, "sum": tm.Sum, "max": tm.Max, "min": tm.Min}
        self.metrics = {f"m{i}": make[k]() for i, k in enumerate(kinds)}

    def update_mean(self, loss: torch.Tensor, n_tokens: torch.Tensor) -> None:
        self.metrics["m0"].update(loss, weight=n_tokens)

    def fill(self, rank: int) -> None:
        for i, metric in enumerate(self.metrics.values()):
            metric.update(torch.tensor(float(rank + i)))

    def sync(self) -> None:
        from torcheval.metrics.toolkit import get_synced_metric_collection

        get_synced_metric_collection(self.metrics)


CONTESTANTS: dict[str, type] = {
    "floor": Floor,
    "torchtelemetry": Telemetry,
    "torchmetrics": TorchMetrics,
    "torcheval": TorchEval,
}


# -- measurement (runs on every rank) ----------------------------------------------------------


def _time_updates(contestant: Any, updates: int, repeats: int) -> float:
    loss = torch.tensor(2.5)
    n_tokens = torch.tensor(512)
    for _ in range(200):
        contestant.update_mean(loss, n_tokens)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(updates):
            contestant.update_mean(loss, n_tokens)
        samples.append((time.perf_counter() - start) / updates * 1e6)
    return statistics.median(samples)


def _time_syncs(contestant: Any, counter: CollectiveCounter, syncs: int) -> tuple[float, int]:
    after = getattr(contestant, "after_sync", lambda: None)
    for _ in range(5):  # warm up: the first sync may add a one-off layout check
        contestant.sync()
        after()
    with counter.counting() as calls:
        contestant.sync()
    collectives = sum(calls.values())
    after()
    total = 0.0
    for _ in range(syncs):
        dist.barrier()
        start = time.perf_counter()
        contestant.sync()
        total += time.perf_counter() - start
        after()
    return total / syncs * 1e6, collectives


def _bench_rank(rank: int, world_size: int, updates: int, syncs: int, repeats: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counter = CollectiveCounter()
    results: dict[str, Any] = {}
    for name, cls in CONTESTANTS.items():
        row: dict[str, Any] = {"update_us": _time_updates(cls(["mean"]), updates, repeats)}
        workloads = {f"mean x{k}": ["mean"] * k for k in _SYNC_SIZES}
        workloads["mixed x128"] = [_KINDS[i % 4] for i in range(128)]
        for label, kinds in workloads.items():
            contestant = cls(kinds)
            contestant.fill(rank)
            row[label] = _time_syncs(contestant, counter, syncs)
        results[name] = row
    return results


def _table(results: dict[str, Any]) -> str:
    floor = results["floor"]
    labels = [label for label in floor if label != "update_us"]
    header = ["library", "update (us)"] + [f"sync {label} (us, collectives)" for label in labels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, row in results.items():
        cells = [name, f"{row['update_us']:.1f} ({row['update_us'] / floor['update_us']:.2f}x)"]
        for label in labels:
            micros, collectives = row[label]
            cells.append(f"{micros:.0f} ({micros / floor[label][0]:.2f}x), {collectives}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20000, help="updates per timing sample")
    parser.add_argument("--repeats", type=int, default=5, help="timing samples per update figure (median)")
    parser.add_argument("--syncs", type=int, default=200, help="timed syncs per workload")
    args = parser.parse_args()
    per_rank = run_ranks(_bench_rank, 2, args.updates, args.syncs, args.repeats, timeout_s=1800)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, world size 2 (gloo)")
    print(_table(per_rank[0]))


if __name__ == "__main__":
    main()
