"""Step cost of `Telemetry.watch_layers` on a small transformer, averaged over a window and on the
measured step itself; bytes each layer adds to the window's collective.

    .venv/bin/python -m bench.bench_layers                # --steps 100 --rounds 7 --every 50
    python -m bench.bench_layers --device cuda            # on a GPU (times with synchronize per step)

One process (no process group). Two variants run the same training loop (forward, backward, SGD
step, `telemetry.step()`, a window every `--every` steps): a `Telemetry` without `watch_layers`,
and one with `watch_layers(model, every=--every)` (norms measured once per window; every step each
layer's output and gradients are checked for NaN). Rounds of `--steps` steps alternate between the
variants (on separate model copies); each step is timed: on CPU by the training thread's CPU time (torch on
one thread; autograd runs on it), which a shared, loaded host disturbs far less than wall time; on
CUDA by wall time with a synchronize per step. Reported: the mean step over the best
round of each (the window average, the issue's goal: under 1 %), and the median of the measured
steps and of the other steps of the watched variant against the median step without it.
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


def _run(model, telemetry, batches, device, first_step: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_metric = telemetry.metrics["train"]["loss"]
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    times = []
    for offset, (tokens, targets) in enumerate(batches):
        start = clock()
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_metric.update(loss.detach())
        telemetry.step(first_step + offset)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=128)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 2048
    base_model = Transformer(vocab, args.width, args.depth, heads=4).to(device)
    models = {"without": base_model, "watch_layers": copy.deepcopy(base_model)}
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
    telemetries["watch_layers"].watch_layers(models["watch_layers"], every=args.every)
    batches = [
        (torch.randint(vocab, (args.batch, args.sequence), device=device),) * 2 for _ in range(args.steps)
    ]
    per_round: dict[str, list[list[float]]] = {name: [] for name in models}
    steps_done = dict.fromkeys(models, 0)
    for name in models:  # warm-up: one window each
        _run(models[name], telemetries[name], batches[: args.every], device, 0)
        steps_done[name] = args.every
    for _ in range(args.rounds):
        for name in models:
            per_round[name].append(_run(models[name], telemetries[name], batches, device, steps_done[name]))
            steps_done[name] += args.steps
    state = telemetries["watch_layers"]._signals.metrics()["train/layer/window"]
    layers = len(state.layers)
    payload = sum(acc.local.numel() * acc.local.element_size() for acc in state.accumulators.values())
    for telemetry in telemetries.values():
        telemetry.close()

    best = {name: min(statistics.fmean(times) for times in rounds) for name, rounds in per_round.items()}
    base = best["without"]
    parameters = sum(p.numel() for p in base_model.parameters())
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
        f"{'1 thread, ' if device.type == 'cpu' else ''}transformer width {args.width} depth {args.depth} "
        f"({parameters / 1e6:.1f} M parameters, {layers} layers watched), "
        f"batch {args.batch}x{args.sequence}, window every {args.every} steps, "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(f"{'variant':<34} {'step (best round mean)':>24} {'vs without':>12}")
    for name, value in best.items():
        print(f"{name:<34} {value * 1e3:>21.3f} ms {100 * (value - base) / base:>+11.2f}%")
    measured, other = [], []
    first = args.every
    for round_index, times in enumerate(per_round["watch_layers"]):
        for offset, seconds in enumerate(times):
            step_count = first + round_index * args.steps + offset + 1
            (measured if step_count % args.every == 0 else other).append(seconds)
    plain = statistics.median(t for times in per_round["without"] for t in times)
    print(f"median step without:               {plain * 1e3:.3f} ms")
    for label, values in (("measured steps", measured), ("other steps", other)):
        median = statistics.median(values)
        print(
            f"median of the {label:<19} {median * 1e3:.3f} ms ({100 * (median - plain) / plain:+.2f}%, "
            f"{len(values)} steps)"
        )
    print(
        f"window payload added: {payload} bytes for {layers} layers = "
        f"{payload / max(layers, 1):.0f} bytes per layer"
    )


if __name__ == "__main__":
    main()
