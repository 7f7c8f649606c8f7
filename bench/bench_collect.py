"""What asynchronous collection costs the training loop (AsyncMetricCollector, 2 gloo ranks).

Run from the repository root (2 gloo ranks on this machine's CPUs by default):

    .venv/bin/python -m bench.bench_collect [--metrics 128] [--windows 200] [--reps 30] [--steps 100]
        [--world-size 2]

1. **schedule vs blocking**: 128 metrics (weighted mean / sum / max / min, cycling). Per
   window every metric gets one update, then rank 0 times, alternately, the main thread's
   time inside `schedule_collection()` (the collection then finishes off the main thread
   and is collected outside the timing) and a blocking `sync_metrics` + each metric's
   `compute()` + `.item()` of every result. Medians over `--windows` windows.
2. **training loop**: a small MLP trained with DDP (gloo) on synthetic data; steps/s with
   no metrics at all, with the four metrics of the design example (loss weighted by tokens,
   accuracy, grad-norm histogram, token counter) updated every step but never collected,
   and the same metrics collected every 10 steps (`schedule_collection()`, results read
   whenever `ready()`, the way `Telemetry.step` does), optionally also collecting 124 more
   idle metrics. The variants run interleaved in the same processes, `--reps` repetitions of
   `--steps` steps each, rotating their order; the overhead is the median over repetitions of
   the slowdown against "no metrics" in the same repetition.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from tests.distributed import run_ranks
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.report import to_python

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
_EVERY = 10


def _many_metrics(count: int) -> dict[str, tt.Metric]:
    return {f"m{i:03d}": _KINDS[i % len(_KINDS)]() for i in range(count)}


def _fill(metrics: dict[str, tt.Metric], value: torch.Tensor) -> None:
    for metric in metrics.values():
        metric.update(value)


# -- 1. main-thread time in schedule_collection vs the blocking path ---------------------------


def _schedule_vs_blocking(rank: int, count: int, windows: int) -> dict[str, float]:
    metrics = _many_metrics(count)
    value = torch.tensor(float(rank + 1))
    schedule_s, schedule_cpu_s, blocking_s = [], [], []
    with AsyncMetricCollector(metrics) as collector:
        for window in range(windows + 5):  # the first windows warm up (layout checks, allocator)
            _fill(metrics, value)
            started, started_cpu = time.perf_counter(), time.thread_time()
            collector.schedule_collection()
            scheduled, scheduled_cpu = time.perf_counter() - started, time.thread_time() - started_cpu
            collector.collect_results()

            _fill(metrics, value)
            started = time.perf_counter()
            tt.sync_metrics(metrics)
            _ = [to_python(metric.compute()) for metric in metrics.values()]
            blocking = time.perf_counter() - started
            for metric in metrics.values():
                metric.reset()
            if window >= 5:
                schedule_s.append(scheduled)
                schedule_cpu_s.append(scheduled_cpu)
                blocking_s.append(blocking)
    return {
        "schedule_us": statistics.median(schedule_s) * 1e6,
        "schedule_cpu_us": statistics.median(schedule_cpu_s) * 1e6,
        "blocking_us": statistics.median(blocking_s) * 1e6,
    }


# -- 2. the training loop -------------------------------------------------------------------


class _Loop:
    """A small MLP under DDP and its synthetic batches; identical on every rank up to the data."""

    def __init__(self, rank: int, width: int, batch: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )  # fmt: skip
        self.model = DistributedDataParallel(model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        self.inputs = [torch.randn(batch, width, generator=gen) for _ in range(8)]
        self.targets = [torch.randint(0, 10, (batch,), generator=gen) for _ in range(8)]
        self.tokens = torch.tensor(batch * 128)

    def step(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.inputs[index % 8], self.targets[index % 8]
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9)
        self.optimizer.step()
        return loss.detach(), logits.detach(), y, grad_norm


def _design_metrics() -> dict[str, tt.Metric]:
    return {
        "loss": tt.WeightedMeanMetric(),
        "accuracy": tt.AccuracyMetric(),
        "grad_norm": tt.HistogramMetric(bins=[0.1, 0.5, 1, 2, 5, 10]),
        "tokens": tt.SumMetric(kind="counter"),
    }


def _run_variant(loop: _Loop, variant: str, steps: int, state: dict[str, Any]) -> float:
    metrics, collector = state.get(variant, (None, None))
    dist.barrier()
    started = time.perf_counter()
    for index in range(steps):
        loss, logits, targets, grad_norm = loop.step(index)
        if metrics is None:
            continue
        metrics["loss"].update(loss, loop.tokens)
        metrics["accuracy"].update(logits, targets)
        metrics["grad_norm"].update(grad_norm)
        metrics["tokens"].update(loop.tokens)
        if collector is not None and (index + 1) % _EVERY == 0:
            collector.schedule_collection()
            while collector.ready():
                collector.collect_results()
    elapsed = time.perf_counter() - started
    if collector is not None:
        while collector.pending:
            collector.collect_results()
    else:
        for metric in (metrics or {}).values():
            metric.reset()
    return steps / elapsed


def _training_loop(
    rank: int, reps: int, steps: int, width: int, batch: int, idle: int
) -> dict[str, tuple[float, float, float]]:
    """Per variant: the median steps/s, and the median over repetitions of the slowdown against
    "no metrics" and against "updates only" run in the same repetition (paired, so that load
    changes on a shared machine cancel out)."""
    loop = _Loop(rank, width, batch)
    state: dict[str, Any] = {"updates only": (_design_metrics(), None)}
    collected = _design_metrics()
    state["collect every 10"] = (collected, AsyncMetricCollector(collected).bind())
    if idle:
        with_idle = _design_metrics()
        tree = {"design": with_idle, "idle": _many_metrics(idle)}
        state[f"collect every 10, +{idle} idle"] = (with_idle, AsyncMetricCollector(tree).bind())
    variants = ["no metrics", *state]
    _run_variant(loop, "no metrics", steps // 4, state)  # warm-up
    rates: dict[str, list[float]] = {variant: [] for variant in variants}
    for rep in range(reps):
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            rates[variant].append(_run_variant(loop, variant, steps, state))
    for _, collector in state.values():
        if collector is not None:
            collector.unbind()

    def slowdown(values: list[float], reference: list[float]) -> float:
        return statistics.median(1 - rate / base for rate, base in zip(values, reference, strict=True))

    return {
        variant: (
            statistics.median(values),
            slowdown(values, rates["no metrics"]),
            slowdown(values, rates["updates only"]),
        )
        for variant, values in rates.items()
    }


def _bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "schedule": _schedule_vs_blocking(rank, args.metrics, args.windows),
        "loop": _training_loop(rank, args.reps, args.steps, args.width, args.batch, args.idle),
    }


def _report(result: dict[str, Any], args: argparse.Namespace) -> str:
    schedule = result["schedule"]
    ratio = schedule["schedule_us"] / schedule["blocking_us"]
    lines = [
        f"| {args.metrics} metrics, rank 0 main thread | median µs |",
        "|---|---|",
        f"| `schedule_collection()` | {schedule['schedule_us']:.0f} ({ratio:.1%} of blocking) |",
        f"| `schedule_collection()`, main-thread CPU time | {schedule['schedule_cpu_us']:.0f} "
        f"({schedule['schedule_cpu_us'] / schedule['blocking_us']:.1%}) |",
        f"| `sync_metrics` + `compute()` + `.item()`s | {schedule['blocking_us']:.0f} |",
        "",
        f"| training loop (MLP width {args.width}, batch {args.batch}, DDP) | steps/s "
        "| overhead vs no metrics | vs updates only |",
        "|---|---|---|---|",
    ]
    for variant, (rate, overhead, collection) in result["loop"].items():
        lines.append(f"| {variant} | {rate:.1f} | {overhead:+.1%} | {collection:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=int, default=128)
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--idle", type=int, default=124, help="extra idle metrics collected (0: skip)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (1: one free core)")
    args = parser.parse_args()
    per_rank = run_ranks(_bench_rank, args.world_size, args, timeout_s=3600)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"world size {args.world_size} (gloo)"
    )
    print(_report(per_rank[0], args))


if __name__ == "__main__":
    main()
