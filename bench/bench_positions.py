"""Where a window's cost lands: README's set, step CPU by position in the window, against the floor.

    PYTHONPATH=src:. .venv/bin/python -m bench.bench_positions [--every 10] [--windows 100] [--rounds 6]

One process, one torch thread, CPU; the workloads of bench/bench_launches.py. README's loop with a
window every `--every` steps, the same loop with no window at all, and the hand-written floor run
in interleaved rounds of `--windows` windows each. Per position in the window (0: the step after a
window's step; `every - 1`: the window's step, which hands the window to the collector's worker),
the median thread CPU of that position's steps over all rounds, as a ratio to the floor's median
step: the steps that share the CPU with the worker building the last window's report show as the
first few positions; the no-window loop shows what a step costs with no worker at all.

Then what the machine does with a thread that sleeps between windows, as the collector's worker
does: the thread CPU of a woken thread's first small torch op and of its second, while the loop
runs, and of the same op on the training thread. A first op that costs many times the second says
that the code a thread runs once per window runs cold (caches, a vCPU woken), whatever it does.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch
from bench.bench_launches import Step, floor_readme, telemetry_readme


def positions(step: Step, every: int, windows: int, start: int, clocks: list[list[int]] | None) -> None:
    """Run `windows` periods of `every` steps from step `start`, adding each step's thread CPU (ns)
    to `clocks[position in the period]` (None: a warm-up, kept nowhere)."""
    for index in range(start, start + every * windows):
        begin = time.thread_time_ns()
        step(index, index % every == every - 1)
        if clocks is not None:
            clocks[index % every].append(time.thread_time_ns() - begin)


def woken_ops(every: int, windows: int) -> tuple[float, float, float]:
    """Median thread CPU µs of a woken thread's first and second `fill_` (one wake-up per window of
    the floor's steps), and of a `fill_` on the training thread between steps."""
    step, _ = floor_readme()
    first_entry, second_entry, third_entry = torch.zeros(3).unbind()
    wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
    first: list[int] = []
    second: list[int] = []

    def woken() -> None:
        while wake.get():
            begin = time.thread_time_ns()
            first_entry.fill_(1.0)
            middle = time.thread_time_ns()
            second_entry.fill_(1.0)
            first.append(middle - begin)
            second.append(time.thread_time_ns() - middle)

    thread = threading.Thread(target=woken, daemon=True)
    thread.start()
    here = []
    for index in range(every * windows):
        step(index, False)
        if index % every == every - 1:
            wake.put(True)
        begin = time.thread_time_ns()
        third_entry.fill_(1.0)
        here.append(time.thread_time_ns() - begin)
    wake.put(False)
    thread.join()
    woken_first, woken_second, training = (statistics.median(cpu) / 1e3 for cpu in (first, second, here))
    return woken_first, woken_second, training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--windows", type=int, default=100, help="windows per round")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (the first is a warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    every = args.every
    built = {  # Telemetry windows by its own `every`; the floor's window is position every - 1
        f"every {every}": telemetry_readme(every),
        "no window": telemetry_readme(10**9),
        "floor": floor_readme(),
    }
    clocks: dict[str, list[list[int]]] = {name: [[] for _ in range(every)] for name in built}
    for round_ in range(args.rounds):
        for name, (step, _) in built.items():
            kept = clocks[name] if round_ else None  # round 0 warms up
            positions(step, every, args.windows, round_ * every * args.windows, kept)
    for _, close in built.values():
        close()
    floor = statistics.median(value for clock in clocks["floor"][: every - 1] for value in clock)
    print(f"torch {torch.__version__}; the floor's median step {floor / 1e3:.1f} µs\n")
    print("| position | " + " | ".join(f"README's set, {name}" for name in built if name != "floor") + " |")
    print("|---" * (len(built)) + "|")
    for position in range(every):
        ratios = [statistics.median(clocks[name][position]) / floor for name in built if name != "floor"]
        print(f"| {position} | " + " | ".join(f"{ratio:.2f}x" for ratio in ratios) + " |")
    first, second, here = woken_ops(every, args.windows)
    print(f"\nA thread woken once per window: its first `fill_` {first:.1f} µs of CPU, ", end="")
    print(f"its second {second:.1f} µs; the same op on the training thread {here:.1f} µs")


if __name__ == "__main__":
    main()
