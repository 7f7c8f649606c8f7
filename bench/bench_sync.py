"""Update and sync cost of torchtelemetry vs torchmetrics, torcheval and a hand-written floor.

Run from the repository root (2 gloo ranks on this machine's CPUs):

    .venv/bin/python -m bench.bench_sync [--updates 20000] [--syncs 100] [--rounds 5]

Per library it measures, on rank 0 of a real 2-rank gloo group:
  * microseconds per `update(loss, n_tokens)` of a weighted mean (0-d float32 loss,
    0-d int64 token count, as a training step produces them);
  * microseconds per sync of K weighted means (K = 1, 16, 128), and of 128 mixed
    metrics (weighted mean / sum / max / min), with the number of torch.distributed
    collectives one sync issues (counted by wrapping the collectives, outermost call only).

The floor keeps the same states in plain tensors updated with `add_` and syncs them with
one `torch.cat` + one packed `all_reduce` per reduce op (1 for means, 2 for the mixed set).
Libraries are interleaved round by round and the fastest round is kept (the machine is shared);
figures are printed as a Markdown table with ratios to the floor.
"""

from __future__ import annotations

import argparse
import functools
import platform
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


def _time_updates(contestant: Any, updates: int) -> float:
    loss = torch.tensor(2.5)
    n_tokens = torch.tensor(512)
    start = time.perf_counter()
    for _ in range(updates):
        contestant.update_mean(loss, n_tokens)
    return (time.perf_counter() - start) / updates * 1e6


def _time_syncs(contestant: Any, syncs: int) -> float:
    after = getattr(contestant, "after_sync", lambda: None)
    total = 0.0
    for _ in range(syncs):
        dist.barrier()
        start = time.perf_counter()
        contestant.sync()
        total += time.perf_counter() - start
        after()
    return total / syncs * 1e6


def _count_collectives(contestant: Any, counter: CollectiveCounter) -> int:
    after = getattr(contestant, "after_sync", lambda: None)
    for _ in range(3):  # warm up: the first sync may add a one-off layout check
        contestant.sync()
        after()
    with counter.counting() as calls:
        contestant.sync()
    after()
    return sum(calls.values())


def _bench_rank(rank: int, world_size: int, updates: int, syncs: int, rounds: int) -> dict[str, Any]:
    """Rounds interleave the libraries, so that load from other processes hits them alike; the
    figure kept per library and workload is the fastest round (the least disturbed)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counter = CollectiveCounter()
    workloads = {f"mean x{k}": ["mean"] * k for k in _SYNC_SIZES}
    workloads["mixed x128"] = [_KINDS[i % 4] for i in range(128)]
    updaters = {name: cls(["mean"]) for name, cls in CONTESTANTS.items()}
    syncers = {
        name: {label: cls(kinds) for label, kinds in workloads.items()} for name, cls in CONTESTANTS.items()
    }
    results: dict[str, Any] = {name: {"update_us": float("inf")} for name in CONTESTANTS}
    for name, per_label in syncers.items():
        _time_updates(updaters[name], 200)
        for label, contestant in per_label.items():
            contestant.fill(rank)
            results[name][label] = (float("inf"), _count_collectives(contestant, counter))
    for _ in range(rounds):
        for name in CONTESTANTS:
            results[name]["update_us"] = min(
                results[name]["update_us"], _time_updates(updaters[name], updates)
            )
        for label in workloads:
            for name in CONTESTANTS:
                # The peers' per-metric syncs are two orders of magnitude slower: fewer of them.
                count = (
                    syncs
                    if name in ("floor", "torchtelemetry") or label == "mean x1"
                    else max(3, syncs // 20)
                )
                micros = _time_syncs(syncers[name][label], count)
                best, collectives = results[name][label]
                results[name][label] = (min(best, micros), collectives)
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
    parser.add_argument("--syncs", type=int, default=100, help="syncs per timing sample")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing samples per figure (the fastest is kept)"
    )
    args = parser.parse_args()
    per_rank = run_ranks(_bench_rank, 2, args.updates, args.syncs, args.rounds, timeout_s=1800)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, world size 2 (gloo)")
    print(_table(per_rank[0]))


if __name__ == "__main__":
    main()
