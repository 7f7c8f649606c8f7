"""Instructions a training step costs the training thread, counted by valgrind: the contestants of
bench_launches.py, hardware-independent and free of the machine's noise.

    PYTHONPATH=src:. .venv/bin/python -m bench.bench_instructions [--steps 100] [--every 10] [--jobs 2]

Each contestant of bench_launches.py (README's set; `--sizes` adds K-means workloads) runs in a
process of its own under `valgrind --tool=callgrind --separate-threads=yes`, twice: `--steps` steps
and three times as many. What the longer run counted beyond the shorter, over the 2 x `--steps`
steps between them, is what a step costs (a window every `--every` steps at its share); start-up,
warm-up and `close()` cancel out. Per contestant:

- **instructions per step** on the training thread (valgrind's thread 1), and the ratio to the
  hand-written floor's;
- **instructions per window** on the process's other threads (the collector's worker building the
  report, the hang detection's threads; 0 for the peers, which run no thread of their own).

What it does not see, and bench_launches.py's thread CPU does: what an instruction costs (cache
misses, the interpreter's footprint), a wait for the GIL and the kernel's part of a hand-off between
threads. Needs valgrind (Debian's `valgrind`); a run takes about 100 s of CPU, mostly importing torch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
from bench import bench_launches

FLOOR = "hand-written floor"


def run_child(name: str, size: int | None, steps: int, every: int) -> None:
    """In the process valgrind runs: `steps` steps of contestant `name`, then close it."""
    torch.set_num_threads(1)
    step, close = bench_launches.contestants(size, every)[name]()
    for index in range(steps):
        step(index, index % every == every - 1)
    close()


def counted(name: str, size: int | None, steps: int, every: int, folder: pathlib.Path) -> tuple[int, int]:
    """Instructions of the training thread and of the other threads of one run under callgrind."""
    out = folder / f"{''.join(c if c.isalnum() else '-' for c in name)}-{size}-{steps}.out"
    child = [sys.executable, "-m", "bench.bench_instructions", "--child", name, "--steps", str(steps)]
    child += ["--every", str(every), "--sizes", "" if size is None else str(size)]
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict and set layouts in every run
    done = subprocess.run([*command, *child], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}, {steps} steps: valgrind exited {done.returncode}: {done.stderr[-2000:]}")
    training = other = 0
    parts = list(folder.glob(f"{out.name}-*"))
    if not any(part.name.endswith("-01") for part in parts):
        raise RuntimeError(f"{name}, {steps} steps: valgrind wrote no count of the training thread")
    for part in parts:
        totals = [line for line in part.read_text().splitlines() if line.startswith("totals:")]
        instructions = int(totals[0].split()[1])
        if part.name.endswith("-01"):
            training = instructions
        else:
            other += instructions
    return training, other


def measure(size: int | None, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per contestant: instructions per step on the training thread, and per window on the others
    (NaN when no window came within the runs' steps)."""
    all_names = list(bench_launches.contestants(size, args.every))
    unknown = sorted(set(args.only) - set(all_names))
    if unknown:
        raise SystemExit(f"bench_instructions: no contestant {unknown}; there are {all_names}")
    chosen = set(args.only or all_names) | {FLOOR}
    names = [name for name in all_names if name in chosen]
    runs = [(name, steps) for name in names for steps in (args.steps, 3 * args.steps)]
    with tempfile.TemporaryDirectory() as folder, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            run: pool.submit(counted, run[0], size, run[1], args.every, pathlib.Path(folder)) for run in runs
        }
        totals = {run: future.result() for run, future in futures.items()}
    windows = 2 * args.steps // args.every
    results = {}
    for name in names:
        (short, short_other), (long, long_other) = totals[name, args.steps], totals[name, 3 * args.steps]
        per_window = (long_other - short_other) / windows if windows else math.nan
        results[name] = ((long - short) / (2 * args.steps), per_window)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the shorter run (the longer: 3x)")
    parser.add_argument("--every", type=int, default=10, help="steps per window")
    parser.add_argument("--sizes", default="", help="K of K-means workloads, besides README's set")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    parser.add_argument("--only", nargs="*", default=[], help="these contestants only (and the floor)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes: list[int | None] = [int(size) for size in args.sizes.split(",") if size]
    if args.child is not None:
        run_child(args.child, sizes[0] if sizes else None, args.steps, args.every)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: needs valgrind (apt-get install -y valgrind)")
    print(f"torch {torch.__version__}, every={args.every}, {args.steps} and {3 * args.steps} steps a run")
    for size in [*sizes, None]:
        results = measure(size, args)
        floor = results[FLOOR][0]
        title = "README's set" if size is None else f"K = {size} weighted means"
        print(f"\n{title}\n")
        print("| contestant | instructions per step | vs floor | other threads' instructions per window |")
        print("|---|---|---|---|")
        for name, (per_step, per_window) in results.items():
            background = "-" if math.isnan(per_window) else f"{max(per_window, 0.0):,.0f}"
            print(f"| {name} | {per_step:,.0f} | {per_step / floor:.3f}x | {background} |")


if __name__ == "__main__":
    main()
