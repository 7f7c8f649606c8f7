"""Training-thread cost of the health signals per step: phases and the non-finite sentinel, on vs off.

    .venv/bin/python -m bench.bench_health          # --steps 5000 --rounds 7 --every 10

One process (no process group). Each variant runs the same loop, with no model: the loss metric
updated with a 0-d loss and its token count, `telemetry.step()` with the token count (a
collection every `--every` steps, its flush and snapshot on this thread), and, as its name says,
three phase sections (forward, backward, optimizer) and a data wait around empty blocks, and the
sentinel counting the loss's non-finite values in `update()`. Variants are interleaved round by
round; the fastest round of each is kept, and the cost is its time per step minus the bare
variant's, also as a share of a 6.6 ms CPU step (the issue's goal: at most 1 %).

The wait measurement (`watch_gradient_sync`) is reported apart, per backward pass: a forward and
backward through a 4x4 linear layer whose outputs are marked (the forward hook, the gradient's
tensor hook, the two autograd-engine callbacks), against the same through an unwatched one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
import timeit
from collections.abc import Callable

import torch

import torchtelemetry as tt
from torchtelemetry.report.signals import SignalContext, SyncWait

VARIANTS = {  # name: (timed sections, TelemetryConfig fields)
    "bare (signals on, no phases, no sentinel)": (False, {"phases": (), "nonfinite": ()}),
    "phases (3 sections + data wait)": (True, {"nonfinite": ()}),
    "sentinel (loss counted)": (False, {"phases": ()}),
    "phases + sentinel": (True, {}),
}
STEP_S = 6.6e-3


def _loop(telemetry: tt.Telemetry, phased: bool) -> Callable[[int], None]:
    loss_metric = telemetry.metrics["train"]["loss"]
    loss, tokens = torch.tensor(2.5), torch.tensor(512)
    phase = telemetry.phase if phased else (lambda name: contextlib.nullcontext())
    data_wait = telemetry.data_wait if phased else contextlib.nullcontext

    def run(steps: int) -> None:
        for step in range(steps):
            with data_wait():
                pass
            with phase("forward"):
                pass
            with phase("backward"):
                pass
            with phase("optimizer"):
                pass
            loss_metric.update(loss, tokens)
            telemetry.step(step, tokens=tokens)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loops = {}
    telemetries = []
    for name, (phased, fields) in VARIANTS.items():
        telemetry = tt.Telemetry(
            {"train": {"loss": tt.WeightedMeanMetric()}}, [], every=args.every, nvml=False, **fields
        )
        telemetries.append(telemetry)
        loops[name] = _loop(telemetry, phased)
    best = dict.fromkeys(loops, float("inf"))
    for run in loops.values():
        run(args.steps // 10)  # warm-up
    for _ in range(args.rounds):
        for name, run in loops.items():
            start = time.perf_counter()
            run(args.steps)
            best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
    pieces = _pieces(telemetries[-1])
    syncs = _host_syncs(loops[next(reversed(loops))])
    for telemetry in telemetries:
        telemetry.close()
    bare = best[next(iter(best))]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"machine: {machine}, load average {os.getloadavg()[0]:.1f}")
    print(f"{args.steps} steps x {args.rounds} rounds (fastest kept), a collection every {args.every} steps")
    print("| variant | µs per step | added µs | share of a 6.6 ms step |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        added = seconds - bare
        print(f"| {name} | {1e6 * seconds:.1f} | {1e6 * added:+.1f} | {100 * added / STEP_S:.2f} % |")
    print(
        "per call (timeit, fastest of 5):",
        ", ".join(f"{name} {1e6 * t:.2f} µs" for name, t in pieces.items()),
    )
    added = pieces["backward, watched"] - pieces["backward, bare"]
    print(
        f"wait measurement: +{1e6 * added:.2f} µs per backward pass "
        f"({100 * added / STEP_S:.3f} % of a 6.6 ms step)"
    )
    print(f"host syncs seen by tests.hostsync.NoHostSync in 100 steps, phases and sentinel on: {len(syncs)}")
    for sync in sorted(set(syncs)):
        print("  ", sync)


def _host_syncs(run: Callable[[int], None]) -> list[str]:
    """What issue 20's detector sees in 100 steps (every read of a value on this thread counts, the
    CPU-only negative-count check aside)."""
    from tests.hostsync import NoHostSync

    from torchtelemetry.metric._aggregation import _any_negative

    with NoHostSync(exempt=[_any_negative], collect=True) as detector:
        run(100)
    return detector.seen


def _pieces(telemetry: tt.Telemetry) -> dict[str, float]:
    """The training-thread cost of each piece alone: a phase section, a data wait, the counting."""
    loss_metric = telemetry.metrics["train"]["loss"]
    loss, tokens = torch.tensor(2.5), torch.tensor(512)
    forward = telemetry.phase("forward")
    data_wait = telemetry.data_wait()

    def section() -> None:
        with forward:
            pass

    def wait() -> None:
        with data_wait:
            pass

    sync_wait = SyncWait(SignalContext(world_size=1, rank=0, device=torch.device("cpu")))
    bare, watched, inputs = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.randn(2, 4)
    sync_wait.watch_gradient_sync(watched)

    calls = {
        "phase section": section,
        "backward, watched": lambda: watched(inputs).sum().backward(),
        "backward, bare": lambda: bare(inputs).sum().backward(),
        "data wait": wait,
        "update, counted": lambda: loss_metric.update(loss, tokens),
        "update, not counted": lambda: type(loss_metric).update(loss_metric, loss, tokens),
    }
    return {name: min(timeit.repeat(call, number=20000, repeat=5)) / 20000 for name, call in calls.items()}


if __name__ == "__main__":
    main()
