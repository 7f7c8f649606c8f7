"""What a training step costs the training thread in tensor ops and CPU time, as metrics are added.

    PYTHONPATH=src:. .venv/bin/python -m bench.bench_launches [--steps 200] [--rounds 5] [--every 10]

One process, one torch thread, CPU. Each step updates the metrics of a workload and ends as each
library ends a step; every `--every` steps is a window (a logging step; with `--every` past every
step run, e.g. 1000000, none: the window columns read `-`). Per contestant:

- **ops**: ATen ops dispatched on the training thread per step (counted by a `TorchDispatchMode`,
  tests/ops.py; hardware-independent: on a GPU each counted op is about one kernel launch), the
  median over the non-window steps and over the window steps of a counting pass;
- **CPU**: the thread's CPU time per step (`time.thread_time_ns`), the mean over the non-window
  steps of a round, the fastest of `--rounds` rounds interleaved between contestants; and the median
  non-window step of a round (fastest round again): the steps right after a window, which share the
  CPU with the collector's worker building that window's report, weigh in the mean, not the median;
- **hand-offs**: the training thread's voluntary context switches per step (Linux,
  `/proc/thread-self/status`; the median over rounds): how often it waited for the GIL while the
  collector's worker held it (each such wait is a few syscalls, a wake-up on another core, and
  the caches of both threads refilled; the peers run no thread of their own);
- **background CPU**: the CPU time of the process's other threads (the collector's worker) per
  window, the median over rounds.

Workloads:

- **K means** (K = 1, 4, 16, 64): K weighted means updated with a 0-d float32 loss and a Python
  int token count, as README.md's loop does.
- **README's set**: README.md's loop: the loss (weighted by `targets.numel()`), accuracy from
  512 x 64 logits, a grad-norm histogram (0-d, 6 bounds), three phases and the data wait, and
  `step(tokens=, learning_rate=)`.

Contestants: torchtelemetry (`Telemetry`, signals and the sentinel on as by default; for README's set
also with the non-finite sentinel off, `nonfinite=[]`, and with every signal off, `signals=False`:
what each costs), torchmetrics
(`MeanMetric`, `MulticlassAccuracy`; no histogram), torcheval (`Mean`, `MulticlassAccuracy`; no
histogram), a hand-written floor (plain float64 tensors, the kernels each update needs, no check;
host timers for the phases; a window: one packed copy and one zero of the states) and a packed floor
(the same states in one buffer, the step's values stacked and added with one op each). A peer's
window is `compute()` and `reset()` of each metric.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tests.ops import OpCounter

import torchtelemetry as tt

BINS = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0]
PHASES = ("forward", "backward", "optimizer")
TOKENS = 512
BATCH, CLASSES = 512, 64


class Inputs:
    """The tensors of one step: losses, logits, targets, a grad norm (fixed: the counts do not
    depend on the values)."""

    def __init__(self, k: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.losses = [torch.rand((), generator=gen) + 1 for _ in range(k)]
        self.logits = torch.randn(BATCH, CLASSES, generator=gen)
        self.targets = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        self.grad_norm = torch.rand((), generator=gen) * 3


Step = Callable[[int, bool], None]
"""step(index, window): one training step's metric work."""


# -- torchtelemetry ----------------------------------------------------------------------------------


def telemetry_means(k: int, every: int) -> tuple[Step, Callable[[], None]]:
    metrics = {f"train/m{i}": tt.WeightedMeanMetric() for i in range(k)}
    telemetry = tt.Telemetry(metrics, every=every, phases=())
    inputs = Inputs(k)
    means = list(metrics.values())

    def step(index: int, window: bool) -> None:
        for metric, loss in zip(means, inputs.losses, strict=True):
            metric.update(loss, TOKENS)
        telemetry.step(index)

    return step, telemetry.close


def telemetry_readme(every: int, **config: Any) -> tuple[Step, Callable[[], None]]:
    """README.md's loop; `config`: more `TelemetryConfig` keys (the same loop with the sentinel or the
    signals off: with `signals=False` the phases and the data wait are not timed, and `step()`'s
    keywords are not recorded)."""
    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "accuracy": tt.AccuracyMetric(),
            "grad_norm": tt.HistogramMetric(bins=BINS),
        }
    }
    telemetry = tt.Telemetry(metrics, every=every, phases=PHASES, **config)
    inputs = Inputs(1)
    train = metrics["train"]

    def step(index: int, window: bool) -> None:
        with telemetry.data_wait():
            pass
        for phase in PHASES:
            with telemetry.phase(phase):
                pass
        train["loss"].update(inputs.losses[0], inputs.targets.numel())
        train["accuracy"].update(inputs.logits, inputs.targets)
        train["grad_norm"].update(inputs.grad_norm)
        telemetry.step(index, tokens=inputs.targets.numel(), learning_rate=0.1)

    return step, telemetry.close


# -- peers -------------------------------------------------------------------------------------------


def peer_means(library: str, k: int) -> tuple[Step, Callable[[], None]]:
    mean = _peer_mean(library)
    metrics = [mean() for _ in range(k)]
    inputs = Inputs(k)
    update = _peer_update(library)

    def step(index: int, window: bool) -> None:
        for metric, loss in zip(metrics, inputs.losses, strict=True):
            update(metric, loss, TOKENS)
        if window:
            for metric in metrics:
                metric.compute()
                metric.reset()

    return step, lambda: None


def peer_readme(library: str) -> tuple[Step, Callable[[], None]]:
    loss, accuracy = _peer_mean(library)(), _peer_accuracy(library)()
    inputs = Inputs(1)
    update = _peer_update(library)
    timers = HostTimers()

    def step(index: int, window: bool) -> None:
        timers.time_a_step()
        update(loss, inputs.losses[0], inputs.targets.numel())
        accuracy.update(inputs.logits, inputs.targets)
        if window:
            for metric in (loss, accuracy):
                metric.compute()
                metric.reset()

    return step, lambda: None


def _peer_mean(library: str) -> Callable[[], Any]:
    if library == "torchmetrics":
        from torchmetrics.aggregation import MeanMetric

        return MeanMetric
    from torcheval.metrics import Mean

    return Mean


def _peer_accuracy(library: str) -> Callable[[], Any]:
    if library == "torchmetrics":
        from torchmetrics.classification import MulticlassAccuracy

        return lambda: MulticlassAccuracy(num_classes=CLASSES, average="micro")
    from torcheval.metrics import MulticlassAccuracy

    return MulticlassAccuracy


def _peer_update(library: str) -> Callable[[Any, torch.Tensor, int], None]:
    if library == "torchmetrics":
        return lambda metric, value, weight: metric.update(value, weight)
    return lambda metric, value, weight: metric.update(value, weight=weight)


# -- floors ------------------------------------------------------------------------------------------


class HostTimers:
    """The phases and the data wait timed on the host, as a hand-written loop would: seconds per name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(("data", *PHASES), 0.0)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - start

    def time_a_step(self) -> None:
        """The data wait and the phases of a step, around nothing (what the timing itself costs)."""
        with self.section("data"):
            pass
        for phase in PHASES:
            with self.section(phase):
                pass


class FloorStates:
    """Float64 states in one buffer, each a view; a window copies the buffer once and zeroes it."""

    def __init__(self, sizes: list[int]) -> None:
        self.buffer = torch.zeros(sum(sizes), dtype=torch.float64)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.views = [
            self.buffer[start : start + size].view(() if size == 1 else (size,))
            for start, size in zip(starts, sizes, strict=True)
        ]

    def window(self) -> None:
        self.snapshot = self.buffer.clone()
        self.buffer.zero_()


def floor_means(k: int) -> tuple[Step, Callable[[], None]]:
    states = FloorStates([1] * (2 * k))
    sums, weights = states.views[:k], states.views[k:]
    inputs = Inputs(k)

    def step(index: int, window: bool) -> None:
        for weighted, weight, loss in zip(sums, weights, inputs.losses, strict=True):
            weighted.add_(loss, alpha=TOKENS)
            weight.add_(TOKENS)
        if window:
            states.window()

    return step, lambda: None


def packed_means(k: int) -> tuple[Step, Callable[[], None]]:
    buffer = torch.zeros(2 * k, dtype=torch.float64)
    sums, weights = buffer[:k], buffer[k:]
    inputs = Inputs(k)

    def step(index: int, window: bool) -> None:
        tokens = torch.tensor([TOKENS] * k, dtype=torch.float64)
        sums.addcmul_(torch.stack(inputs.losses), tokens)
        weights.add_(tokens)
        if window:
            snapshot = buffer.clone()
            buffer.zero_()
            del snapshot

    return step, lambda: None


def floor_readme() -> tuple[Step, Callable[[], None]]:
    states = FloorStates([1, 1, 1, 1, len(BINS) + 1, 1, 1])
    weighted, weight, correct, total, counts, value_sum, value_count = states.views
    bounds, one = torch.tensor(BINS, dtype=torch.float32), torch.ones((), dtype=torch.float64)
    inputs = Inputs(1)
    timers = HostTimers()

    def step(index: int, window: bool) -> None:
        timers.time_a_step()
        tokens = inputs.targets.numel()
        weighted.add_(inputs.losses[0], alpha=tokens)
        weight.add_(tokens)
        correct.add_((inputs.logits.argmax(-1) == inputs.targets).sum())
        total.add_(inputs.targets.numel())
        counts.index_put_((torch.bucketize(inputs.grad_norm, bounds),), one, accumulate=True)
        value_sum.add_(inputs.grad_norm)
        value_count.add_(1)
        if window:
            states.window()

    return step, lambda: None


def packed_readme() -> tuple[Step, Callable[[], None]]:
    """The step's scalars in one buffer (loss x tokens, tokens, correct, total, grad-norm sum and
    count): the device values stacked, weighted and added with one `index_add_`, the host counts
    with one `add_`; the histogram's bucket with one `index_put_`."""
    buffer = torch.zeros(6 + len(BINS) + 1, dtype=torch.float64)
    scalars, counts = buffer[:6], buffer[6:]
    bounds, one = torch.tensor(BINS, dtype=torch.float32), torch.ones((), dtype=torch.float64)
    stacked_at = torch.tensor([0, 2, 4])
    inputs = Inputs(1)
    timers = HostTimers()

    def step(index: int, window: bool) -> None:
        timers.time_a_step()
        tokens = inputs.targets.numel()
        hits = (inputs.logits.argmax(-1) == inputs.targets).sum(dtype=torch.float64)
        counts.index_put_((torch.bucketize(inputs.grad_norm, bounds),), one, accumulate=True)
        factors = torch.tensor([tokens, 1.0, 1.0], dtype=torch.float64)
        stacked = torch.stack([inputs.losses[0], hits, inputs.grad_norm]) * factors
        scalars.index_add_(0, stacked_at, stacked)
        scalars.add_(torch.tensor([0.0, tokens, 0.0, inputs.targets.numel(), 0.0, 1.0], dtype=torch.float64))
        if window:
            snapshot = buffer.clone()
            buffer.zero_()
            del snapshot

    return step, lambda: None


# -- measuring ---------------------------------------------------------------------------------------


def contestants(k: int | None, every: int) -> dict[str, Callable[[], tuple[Step, Callable[[], None]]]]:
    if k is None:
        return {
            "torchtelemetry": lambda: telemetry_readme(every),
            "torchtelemetry, sentinel off": lambda: telemetry_readme(every, nonfinite=[]),
            "torchtelemetry, signals off": lambda: telemetry_readme(every, signals=False),
            "torchmetrics": lambda: peer_readme("torchmetrics"),
            "torcheval": lambda: peer_readme("torcheval"),
            "hand-written floor": floor_readme,
            "packed floor": packed_readme,
        }
    return {
        "torchtelemetry": lambda: telemetry_means(k, every),
        "torchmetrics": lambda: peer_means("torchmetrics", k),
        "torcheval": lambda: peer_means("torcheval", k),
        "hand-written floor": lambda: floor_means(k),
        "packed floor": lambda: packed_means(k),
    }


def warm_up_steps(steps: int, every: int) -> int:
    """Steps run before counting: two windows (`steps` when no window comes within them)."""
    return 2 * every if every <= steps else steps


def count_ops(step: Step, steps: int, every: int) -> tuple[int, int]:
    """Median ops per non-window step and per window step (after two warm-up windows)."""
    warm = warm_up_steps(steps, every)
    for index in range(warm):
        step(index, index % every == every - 1)
    plain, windows = [], []
    for index in range(warm, warm + steps):
        window = index % every == every - 1
        with OpCounter() as counter:
            step(index, window)
        (windows if window else plain).append(sum(counter.ops.values()))
    return int(statistics.median(plain)), int(statistics.median(windows)) if windows else -1  # -1: none


def voluntary_switches() -> int:
    """This thread's voluntary context switches so far (0 where /proc does not say)."""
    try:
        with open("/proc/thread-self/status") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split(":")[1])
    except OSError:
        pass
    return 0


def cpu_per_step(step: Step, steps: int, every: int, start: int) -> tuple[float, ...]:
    """Thread CPU µs over `steps` steps: the mean non-window step, the mean window step and the
    median non-window step; the thread's voluntary context switches per step, and the other threads'
    CPU µs per window."""
    plain, windows = [], []
    switches, process, thread = voluntary_switches(), time.process_time_ns(), time.thread_time_ns()
    for index in range(start, start + steps):
        window = index % every == every - 1
        begin = time.thread_time_ns()
        step(index, window)
        (windows if window else plain).append(time.thread_time_ns() - begin)
    background = (time.process_time_ns() - process) - (time.thread_time_ns() - thread)
    per_step = (voluntary_switches() - switches) / steps
    window = statistics.fmean(windows) / 1e3 if windows else math.nan  # `--every` past the steps: none
    means = statistics.fmean(plain) / 1e3, window, statistics.median(plain) / 1e3
    return *means, per_step, background / len(windows) / 1e3 if windows else math.nan


def measure(k: int | None, args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    built = {name: make() for name, make in contestants(k, args.every).items()}
    ops = {name: count_ops(step, args.steps, args.every) for name, (step, _) in built.items()}
    cpu = {name: [float("inf")] * 3 for name in built}
    background: dict[str, list[tuple[float, float]]] = {name: [] for name in built}
    start = warm_up_steps(args.steps, args.every) + args.steps
    for round_ in range(args.rounds):
        for name, (step, _) in built.items():
            *measured, switched, other = cpu_per_step(
                step, args.steps, args.every, start + round_ * args.steps
            )
            cpu[name] = [min(best, value) for best, value in zip(cpu[name], measured, strict=True)]
            background[name].append((switched, other))
    for _, close in built.values():
        close()
    return {
        name: (
            *ops[name],
            *cpu[name],
            *(statistics.median(column) for column in zip(*background[name], strict=True)),
        )
        for name in built
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per round (and counted)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the fastest is kept")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--sizes", default="1,4,16,64", help="K of the K-means workload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, every={args.every}")
    workloads: list[int | None] = [int(size) for size in args.sizes.split(",") if size] + [None]
    for k in workloads:
        title = "README's set" if k is None else f"K = {k} weighted means"
        results = measure(k, args)
        floor_cpu, floor_median = results["hand-written floor"][2], results["hand-written floor"][4]
        print(f"\n{title}\n")
        print("| contestant | ops per step | ops per window step | CPU µs per step | vs floor ", end="")
        print("| median step CPU µs | vs floor | window step CPU µs | hand-offs per step ", end="")
        print("| background CPU µs per window |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, (plain, window, cpu, window_cpu, median, switched, other) in results.items():
            ops, cpu_of_window, background = (
                [f"{window:.0f}", f"{window_cpu:.1f}", f"{max(other, 0.0):.0f}"] if window >= 0 else ["-"] * 3
            )
            print(f"| {name} | {plain:.0f} | {ops} | {cpu:.1f} | {cpu / floor_cpu:.2f}x ", end="")
            print(
                f"| {median:.1f} | {median / floor_median:.2f}x | {cpu_of_window} | {switched:.2f} ", end=""
            )
            print(f"| {background} |")


if __name__ == "__main__":
    main()
