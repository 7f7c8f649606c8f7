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

The traces' cost (issue 47): the same loop and figures, an `OTelExporter` pushing to a real OTLP
receiver in a process of its own in both, traces on (`trace_ranks=3`: a world of one is sampled
every window, its traces thread builds and sends every window's spans) and off (`trace_ranks=0`),
heartbeat off, rounds interleaved. Then the training thread's own code alone: an empty section with
the plain timers and the traced ones, and a step's end written to the window's timeline.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tests.distributed import free_port

import torchtelemetry as tt
from torchtelemetry.report.signals import (
    HostClock,
    HostTimer,
    PhaseTimer,
    SectionLog,
    TracedHostClock,
    TracedHostTimer,
    section_kinds,
)

REPO = Path(__file__).resolve().parents[1]
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


def _timers_cost(rounds: int) -> None:
    """What traces add to the training thread's own code, alone (no thread beside it): ns of an empty
    section with the plain timers (traces off) and the traced ones (on), and of a step's end written to
    the window's timeline; thread CPU, median of `rounds` x 200 batches of 1,000, the variants
    interleaved, the timeline sealed after each batch (as a window's schedule does)."""
    log = SectionLog(section_kinds(("forward",)))
    plain_phase = PhaseTimer(HostClock(1), 0, "forward")
    traced_phase = PhaseTimer(TracedHostClock(1, log), 0, "forward")
    plain_data = HostTimer(lambda seconds: None)
    traced_data = TracedHostTimer(lambda seconds: None, "data", log=log, kind=log.kind("data"))

    def sections(timer: Any) -> None:
        for _ in range(1000):
            with timer:
                pass

    def steps(record: bool) -> None:
        for step in range(1000):
            if record:
                log.stepped(step, 0.0)

    variants = {
        "phase(), off": functools.partial(sections, plain_phase),
        "phase(), on": functools.partial(sections, traced_phase),
        "data_wait(), off": functools.partial(sections, plain_data),
        "data_wait(), on": functools.partial(sections, traced_data),
        "a step's end, off": functools.partial(steps, False),
        "a step's end, on": functools.partial(steps, True),
    }
    found: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds * 200):
        for name, run in variants.items():
            started = time.thread_time_ns()
            run()
            found[name].append((time.thread_time_ns() - started) / 1000)
            log.seal()
    print("| training thread, alone | off (ns) | on (ns) | on - off (ns) | on / off |")
    print("|---|---|---|---|---|")
    for what in ("phase()", "data_wait()", "a step's end"):
        off, on = (statistics.median(found[f"{what}, {key}"]) for key in ("off", "on"))
        print(f"| {what} | {off:.0f} | {on:.0f} | {on - off:+.0f} | {on / off:.3f}x |")


@contextlib.contextmanager
def _receiver_process() -> Iterator[str]:
    """A real OTLP/HTTP receiver in a process of its own (its decoding takes no GIL from this one);
    yields its metrics endpoint."""
    port = free_port()
    code = (
        "import sys; from tests.receivers import OtlpHttpReceiver; "
        f"receiver = OtlpHttpReceiver({port}); receiver.start(); sys.stdin.read(); receiver.stop()"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1/metrics"
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)


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
        with _receiver_process() as endpoint:

            def traced(trace_ranks: int) -> tuple[float, float]:
                exporter = tt.OTelExporter(endpoint=endpoint)
                return _sections_window(args.windows, [exporter], hang_after_s=None, trace_ranks=trace_ranks)

            _on_off_cost("traces", args.windows, args.rounds, lambda: traced(0), lambda: traced(3))
        print()
        _timers_cost(args.rounds)
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
