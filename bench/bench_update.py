"""Cost of `update()` against a hand-written floor of the same state dtype, in one process.

    PYTHONPATH=src .venv/bin/python -m bench.bench_update [--updates 20000] [--rounds 15] [--clock thread]

Each row times one update of a built-in metric and the floor: the same kernels on plain tensors
of the metric's state dtype, without checks. The floor of a 0-d weighted mean is a float64
`addcmul_` + `add_`. Rounds are interleaved and the fastest round is kept; the table gives
microseconds and the ratio to the floor. The last rows time the checks added for the threading
and fork rules on their own, in nanoseconds. `--clock thread` times with the thread's CPU time
instead of the wall clock: on a shared machine, time the process spends preempted is not counted.
"""

from __future__ import annotations

import argparse
import threading
import time
import timeit
from collections.abc import Callable

import torch

import torchtelemetry as tt
from torchtelemetry._process import check_same_process, current_pid


def _cases() -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    loss, tokens = torch.tensor(2.5), torch.tensor(512)
    mean = tt.WeightedMeanMetric()
    mean_sum = torch.zeros((), dtype=torch.float64)
    mean_weight = torch.zeros((), dtype=torch.float64)

    def mean_floor() -> None:
        mean_sum.addcmul_(loss, tokens)
        mean_weight.add_(tokens)

    counter = tt.SumMetric(kind="counter")
    counter_state = torch.zeros((), dtype=torch.float64)
    int_counter = tt.SumMetric(kind="counter", dtype=torch.int64)
    int_state = torch.zeros((), dtype=torch.int64)
    half = torch.full((1024,), 0.5, dtype=torch.float16)
    half_sum = tt.SumMetric()
    half_state = torch.zeros((), dtype=torch.float64)
    logits, labels = torch.randn(64, 10), torch.randint(0, 10, (64,))
    accuracy = tt.AccuracyMetric()
    correct, total = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)

    def accuracy_floor() -> None:
        correct.add_((logits.argmax(-1) == labels).sum())
        total.add_(labels.numel())

    bins = [0.1, 0.5, 1, 2, 5, 10]
    histogram = tt.HistogramMetric(bins=bins)
    bounds, grad_norm = torch.tensor(bins, dtype=torch.float64), torch.tensor(1.3)
    counts, value_sum = torch.zeros(len(bins) + 1, dtype=torch.float64), torch.zeros((), dtype=torch.float64)

    def histogram_floor() -> None:
        value = grad_norm.to(torch.float64).reshape(1)
        counts.index_add_(0, torch.bucketize(value, bounds), torch.ones_like(value))
        value_sum.add_(value.sum())

    return {
        "weighted mean, 0-d (loss, tokens)": (mean_floor, lambda: mean.update(loss, tokens)),
        "accuracy, 64 x 10 logits": (accuracy_floor, lambda: accuracy.update(logits, labels)),
        "histogram, 0-d (grad norm), 6 bounds": (histogram_floor, lambda: histogram.update(grad_norm)),
        "counter, 0-d int64 into float64": (
            lambda: counter_state.add_(tokens),
            lambda: counter.update(tokens),
        ),
        "counter, 0-d int64 into int64 (overflow check)": (
            lambda: int_state.add_(tokens),
            lambda: int_counter.update(tokens),
        ),
        "sum, 1024 float16 summed in float64": (
            lambda: half_state.add_(half.sum(dtype=torch.float64)),
            lambda: half_sum.update(half),
        ),
    }


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _time(fn: Callable[[], None], updates: int, clock: Callable[[], float] = time.perf_counter) -> float:
    return timeit.timeit(fn, number=updates, timer=clock) / updates * 1e6


def _checks(updates: int) -> dict[str, float]:
    owner, pid = threading.get_ident(), current_pid()
    get_ident = threading.get_ident
    return {
        "thread check (get_ident() != owner)": min(
            timeit.repeat(lambda: get_ident() != owner, number=updates, repeat=5)
        )
        / updates
        * 1e9,
        "fork check (check_same_process)": min(
            timeit.repeat(lambda: check_same_process(pid, "Telemetry.step"), number=updates, repeat=5)
        )
        / updates
        * 1e9,
        "torch.compiler.is_compiling()": min(
            timeit.repeat(torch.compiler.is_compiling, number=updates, repeat=5)
        )
        / updates
        * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20000, help="updates per timing sample")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds; the fastest is kept")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="wall clock, or the thread's CPU time"
    )
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    cases = _cases()
    best = {name: [float("inf"), float("inf")] for name in cases}
    for floor, update in cases.values():  # warm up
        _time(floor, 200)
        _time(update, 200)
    for _ in range(args.rounds):
        for name, (floor, update) in cases.items():
            best[name][0] = min(best[name][0], _time(floor, args.updates, clock))
            best[name][1] = min(best[name][1], _time(update, args.updates, clock))
    print("| update | floor (us) | torchtelemetry (us) | ratio |")
    print("|---|---|---|---|")
    for name, (floor_us, update_us) in best.items():
        print(f"| {name} | {floor_us:.2f} | {update_us:.2f} | {update_us / floor_us:.2f}x |")
    print()
    print("| check | ns |")
    print("|---|---|")
    for name, nanos in _checks(args.updates * 10).items():
        print(f"| {name} | {nanos:.0f} |")


if __name__ == "__main__":
    main()
