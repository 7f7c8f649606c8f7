"""What `Telemetry.step()` costs the training thread as the number of metrics grows, in one process.

    PYTHONPATH=src .venv/bin/python -m bench.bench_step [--metrics 100,1000,10000] [--windows 40]

A loop of training steps (a CPU matmul of ~2 ms standing in for the step's work; it releases the
GIL, as waiting for a GPU does) with `Telemetry(every=10)` over N metrics (weighted mean / sum /
max / min cycling, one updated per step) and the built-in signals. Per N: the training thread's
time inside `step()` per window (wall and thread CPU, summed over the window's 10 calls; median
over windows after 5 warm-up windows), and its ratio to the smallest N. Figures go to
bench/README.md; the ratio is what the target is about (10,000 metrics within 2x of 100).

    PYTHONPATH=src .venv/bin/python -m bench.bench_step --heartbeat [--windows 40] [--rounds 5]

The heartbeat's cost instead (issue 33): the same loop with 100 metrics, each step's work inside
`data_wait()` and three phases, with the hang heartbeat on (`hang_after_s=300`, its publisher thread
running) and off (`hang_after_s=None`), rounds interleaved. Per window: the training thread's CPU
time (thread CPU: preemption on a busy machine is not the code's cost) inside `step()` and inside
`phase()` / `data_wait()` (entering and leaving, the work excluded), median over rounds of each
round's median window, and the ratio on/off.

    PYTHONPATH=src .venv/bin/python -m bench.bench_step --traces [--windows 40] [--rounds 5]

The traces' cost (issue 47): the same loop and figures, an `OTelExporter` pushing to a local OTLP
receiver in both, traces on (`trace_ranks=3`: a world of one is sampled every window, its traces
thread sends every window's spans) and off (`trace_ranks=0`), heartbeat off, rounds interleaved.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tests.receivers import OtlpHttpReceiver

import torchtelemetry as tt

_KINDS = (tt.WeightedMeanMetric, tt.SumMetric, tt.MaxMetric, tt.MinMetric)
EVERY = 10


def _per_window(num_metrics: int, windows: int) -> tuple[float, float]:
    """Median µs of `step()` per window on the training thread: (wall, thread CPU)."""
    metrics = {f"layer{i % 100}/metric{i}": _KINDS[i % len(_KINDS)]() for i in range(num_metrics)}
    telemetry = tt.Telemetry(metrics, every=EVERY)
    work = torch.randn(256, 256)
    value = torch.tensor(1.0)
    walls, cpus = [], []
    try:
        for window in range(windows + 5):
            wall = cpu = 0.0
            for step in range(window * EVERY, (window + 1) * EVERY):
                for _ in range(8):
                    work = torch.tanh(work @ work)  # the training step's own work (GIL released)
                metrics[f"layer{step % 100}/metric{step % num_metrics}"].update(value)
                started, started_cpu = time.perf_counter(), time.thread_time()
                telemetry.step(step, tokens=512)
                wall += time.perf_counter() - started
                cpu += time.thread_time() - started_cpu
            if window >= 5:
                walls.append(wall)
                cpus.append(cpu)
    finally:
        telemetry.close()
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def _sections_window(windows: int, exporters: list[Any], **fields: Any) -> tuple[float, float]:
    """Median thread-CPU µs per window inside `step()`, and inside `phase()` and `data_wait()`
    (entering and leaving), of a `Telemetry` with `exporters` and `fields`."""
    metrics = {f"metric{i}": _KINDS[i % len(_KINDS)]() for i in range(100)}
    telemetry = tt.Telemetry(metrics, exporters, every=EVERY, **fields)
    phases = [functools.partial(telemetry.phase, name) for name in ("forward", "backward", "optimizer")]
    sections = [telemetry.data_wait, *phases]
    work = torch.randn(256, 256)
    value = torch.tensor(1.0)
    steps, in_sections = [], []
    clock = time.thread_time
    try:
        for window in range(windows + 5):
            in_step = in_phase = 0.0
            for step in range(window * EVERY, (window + 1) * EVERY):
                for section in sections:
                    entering = clock()
                    with section():
                        inside = clock()
                        for _ in range(2):
                            work = torch.tanh(work @ work)  # the section's own work (GIL released)
                        leaving = clock()
                    in_phase += inside - entering + clock() - leaving
                metrics[f"metric{step % 100}"].update(value)
                started = clock()
                telemetry.step(step, tokens=512)
                in_step += clock() - started
            if window >= 5:
                steps.append(in_step)
                in_sections.append(in_phase)
    finally:
        telemetry.close()
    return statistics.median(steps) * 1e6, statistics.median(in_sections) * 1e6


def _on_off_cost(what: str, windows: int, rounds: int, off: Callable[[], Any], on: Callable[[], Any]) -> None:
    """`what` off and on (each a call returning the figures of `_sections_window`), interleaved."""
    figures: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for _ in range(rounds):
        figures["off"].append(off())
        figures["on"].append(on())
    medians = {
        key: tuple(statistics.median(figure[index] for figure in found) for index in (0, 1))
        for key, found in figures.items()
    }
    print(
        f"| {what} | step() per window (thread CPU µs) | phase() + data_wait() per window (thread CPU µs) |"
    )
    print("|---|---|---|")
    for key, (in_step, in_phase) in medians.items():
        print(f"| {key} | {in_step:.1f} | {in_phase:.1f} |")
    (off_step, off_phase), (on_step, on_phase) = medians["off"], medians["on"]
    print(f"| on / off | {on_step / off_step:.3f}x | {on_phase / off_phase:.3f}x |")


def _empty_sections_cost(endpoint: str, windows: int) -> None:
    """ns of an empty section (`phase("forward")`, `phase("backward")`, `phase("optimizer")`,
    `data_wait()`) and of a `step()` that schedules no window, traces off and on: two telemetries
    side by side, their windows interleaved (each window: 10 steps of the four sections, timed in
    thread CPU around each step's four and around each step() but the one that schedules: the
    traces thread's sending, on the other core or between, is not the training thread's cost),
    median over the windows."""
    telemetries = {
        trace_ranks: tt.Telemetry(
            {"loss": tt.SumMetric()},
            [tt.OTelExporter(endpoint=endpoint)],
            every=EVERY,
            hang_after_s=None,
            trace_ranks=trace_ranks,
        )
        for trace_ranks in (0, 3)
    }
    timers = {
        key: [
            telemetry.data_wait(),
            *(telemetry.phase(name) for name in ("forward", "backward", "optimizer")),
        ]
        for key, telemetry in telemetries.items()
    }
    sections: dict[int, list[float]] = {0: [], 3: []}
    steps: dict[int, list[float]] = {0: [], 3: []}
    clock = time.thread_time_ns
    try:
        for window in range(windows + 5):
            for key, telemetry in telemetries.items():
                data, forward, backward, optimizer = timers[key]
                in_sections = in_steps = 0
                for step in range(window * EVERY, (window + 1) * EVERY):
                    started = clock()
                    with data:
                        pass
                    with forward:
                        pass
                    with backward:
                        pass
                    with optimizer:
                        pass
                    in_sections += clock() - started
                    started = clock()
                    telemetry.step(step)
                    if step % EVERY != EVERY - 1:  # not the step() that schedules the window
                        in_steps += clock() - started
                if window >= 5:
                    sections[key].append(in_sections / (4 * EVERY))
                    steps[key].append(in_steps / (EVERY - 1) / 1e3)
    finally:
        for telemetry in telemetries.values():
            telemetry.close()
    medians = {key: (statistics.median(sections[key]), statistics.median(steps[key])) for key in sections}
    print("| traces | empty section (ns) | step() without a window (µs) |")
    print("|---|---|---|")
    for label, key in (("off", 0), ("on", 3)):
        print(f"| {label} | {medians[key][0]:.0f} | {medians[key][1]:.2f} |")
    print(f"| on / off | {medians[3][0] / medians[0][0]:.3f}x | {medians[3][1] / medians[0][1]:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", default="100,1000,10000", help="comma-separated numbers of metrics")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--heartbeat", action="store_true", help="the hang heartbeat's cost instead")
    parser.add_argument("--traces", action="store_true", help="the traces' cost instead")
    parser.add_argument("--rounds", type=int, default=5, help="with --heartbeat, --traces: rounds on and off")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.heartbeat:
        _on_off_cost(
            "heartbeat",
            args.windows,
            args.rounds,
            lambda: _sections_window(args.windows, [], hang_after_s=None),
            lambda: _sections_window(args.windows, [], hang_after_s=300.0),
        )
        return
    if args.traces:
        with OtlpHttpReceiver() as receiver:

            def traced(trace_ranks: int) -> tuple[float, float]:
                exporter = tt.OTelExporter(endpoint=receiver.metrics_endpoint)
                return _sections_window(args.windows, [exporter], hang_after_s=None, trace_ranks=trace_ranks)

            _on_off_cost("traces", args.windows, args.rounds, lambda: traced(0), lambda: traced(3))
            spans = len(receiver.spans())
            print(f"({spans} spans received from the rounds with traces on)\n")
            _empty_sections_cost(receiver.metrics_endpoint, 40 * args.windows)
        return
    sizes = [int(size) for size in args.metrics.split(",")]
    figures = {size: _per_window(size, args.windows) for size in sizes}
    base_wall, base_cpu = figures[sizes[0]]
    print(f"| metrics | step() per window, wall (µs) | vs {sizes[0]} | thread CPU (µs) | vs {sizes[0]} |")
    print("|---|---|---|---|---|")
    for size, (wall, cpu) in figures.items():
        print(f"| {size:,} | {wall:.0f} | {wall / base_wall:.2f}x | {cpu:.0f} | {cpu / base_cpu:.2f}x |")


if __name__ == "__main__":
    main()
