"""Step cost of `Telemetry.watch_layers` on a small transformer, averaged over a window and on the
measured step itself; bytes each layer adds to the window's collective.

    .venv/bin/python -m bench.bench_layers                # --windows 6 --calibrate 2 --every 50 --width 256
    python -m bench.bench_layers --device cuda            # on a GPU (times with synchronize per step)

One process (no process group). Three copies of the same model train on the same batches
(forward, backward, SGD step, `telemetry.step()`, a window every `--every` steps), taking turns step
by step, so a load that comes and goes on a shared host falls on all alike. Each step is timed: on
CPU by the training thread's CPU time (torch on one thread; autograd runs on it), on CUDA by wall
time with a synchronize per step. After one window of warm-up, `--calibrate` windows run with no
layer watched, to measure how fast each copy is on its own (copies in other memory run a percent
or so apart, as fast as each other or not); then one copy gets `watch_layers(model,
every=--every)` (norms measured once per window; every step each layer's output and gradients are
checked for NaN), another `watch_layers(..., nonfinite=False)` (the norms only), and `--windows`
windows run. Reported, each copy's times divided by its calibrated speed: the mean step over the
windows against the copy without (the issue's goal: under 1 % more), and the median of the
step-by-step differences on the measured steps and on the others. Copies of a model run a few
percent apart however they are calibrated on a busy host, so the figure that holds is the last:
the training thread's time inside watch_layers' own code (the checks, their fold once per step,
the measurement), added up by wrapping those calls.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from torch import nn

import torchtelemetry as tt


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _stepper(model: nn.Module, telemetry: tt.Telemetry, device: torch.device):
    """One training step of `model` on a batch, timed."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_metric = telemetry.metrics["train"]["loss"]
    clock = time.perf_counter if device.type == "cuda" else time.thread_time

    def step(index: int, tokens: torch.Tensor) -> float:
        start = clock()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_metric.update(loss.detach())
        telemetry.step(index)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return clock() - start

    return step


def _time_watch_layers(telemetry: tt.Telemetry) -> dict[str, float]:
    """Add up the time the training thread spends in watch_layers' checks, their fold and the
    measurement of the norms (wrapping the objects `watch_layers` made)."""
    spent = dict.fromkeys(("checks", "fold", "measure"), 0.0)
    signal = next(s for s in telemetry._signals.signals if s.name == "layers")
    watched = signal._layers
    for owner, attr, key in (
        (watched.checks, "_probe", "checks"),
        (watched.checks, "fold", "fold"),
        (watched, "measure", "measure"),
    ):
        original = getattr(owner, attr)

        def timed(*args, _original=original, _key=key, **kwargs):
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_key] += time.thread_time() - start

        setattr(owner, attr, timed)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--calibrate", type=int, default=2)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument(
        "--blocks", action="store_true", help="watch the blocks, the embedding and the head (layers=...)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 2048
    base_model = Transformer(vocab, args.width, args.depth, heads=4).to(device)
    models = {
        "without": base_model,
        "watch_layers": copy.deepcopy(base_model),
        "nonfinite=False": copy.deepcopy(base_model),
    }
    telemetries = {
        name: tt.Telemetry(
            {"train": {"loss": tt.WeightedMeanMetric().to(device)}},
            [],
            every=args.every,
            nvml=False,
            hang_after_s=None,
        )
        for name in models
    }
    steppers = {name: _stepper(models[name], telemetries[name], device) for name in models}
    times: dict[str, list[float]] = {name: [] for name in models}

    def train(windows: int) -> dict[str, list[float]]:
        first = len(times["without"])
        for index in range(first, first + windows * args.every):
            tokens = torch.randint(vocab, (args.batch, args.sequence), device=device)
            order = list(models)
            for name in order[index % len(order) :] + order[: index % len(order)]:  # who goes first rotates
                times[name].append(steppers[name](index, tokens))
        return {name: values[first:] for name, values in times.items()}

    train(1)
    calibrated = train(args.calibrate)
    speed = {
        name: statistics.fmean(values) / statistics.fmean(calibrated["without"])
        for name, values in calibrated.items()
    }
    paths = [f"blocks.{i}" for i in range(args.depth)] + ["embed", "norm", "head"] if args.blocks else None
    telemetries["watch_layers"].watch_layers(models["watch_layers"], every=args.every, layers=paths)
    telemetries["nonfinite=False"].watch_layers(
        models["nonfinite=False"], every=args.every, layers=paths, nonfinite=False
    )
    spent = _time_watch_layers(telemetries["watch_layers"])
    kept = {name: [t / speed[name] for t in values] for name, values in train(args.windows).items()}
    state = telemetries["watch_layers"]._signals.metrics()["train/layer/window"]
    layers = len(state.layers)
    payload = sum(acc.local.numel() * acc.local.element_size() for acc in state.accumulators.values())
    for telemetry in telemetries.values():
        telemetry.close()

    mean = {name: statistics.fmean(values) for name, values in kept.items()}
    base = mean["without"]
    parameters = sum(p.numel() for p in base_model.parameters())
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
        f"{'1 thread, ' if device.type == 'cpu' else ''}transformer width {args.width} depth {args.depth} "
        f"({parameters / 1e6:.1f} M parameters, {layers} layers watched), "
        f"batch {args.batch}x{args.sequence}, window every {args.every} steps, {args.windows} windows"
    )
    print(
        "calibrated speed of each copy: " + ", ".join(f"{name} {value:.4f}" for name, value in speed.items())
    )
    for name, value in mean.items():
        print(f"{name:<16} mean step {value * 1e3:9.3f} ms  {100 * (value - base) / base:+6.2f}%")
    for name in ("watch_layers", "nonfinite=False"):
        differences = [with_ - without for with_, without in zip(kept[name], kept["without"], strict=True)]
        measured = [d for offset, d in enumerate(differences) if (offset + 1) % args.every == 0]
        others = [d for offset, d in enumerate(differences) if (offset + 1) % args.every]
        for label, values in (("measured steps", measured), ("other steps", others)):
            median = statistics.median(values)
            print(
                f"{name}, {label}: median difference {median * 1e3:+.3f} ms "
                f"({100 * median / base:+.2f}% of the mean step, {len(values)} steps)"
            )
    steps = args.windows * args.every
    checks = (spent["checks"] + spent["fold"]) / steps
    print(
        f"watch_layers' own code on the training thread ({'CPU' if device.type == 'cpu' else 'launch'} "
        f"time): checks {checks * 1e3:.3f} ms per step ({100 * checks / base:.2f}%), measurement "
        f"{spent['measure'] / args.windows * 1e3:.3f} ms per measured step "
        f"({100 * spent['measure'] / args.windows / base:.2f}% of a step, "
        f"{100 * spent['measure'] / steps / base:.3f}% averaged over the window)"
    )
    print(
        f"window payload added: {payload} bytes for {layers} layers = "
        f"{payload / max(layers, 1):.0f} bytes per layer"
    )


if __name__ == "__main__":
    main()
