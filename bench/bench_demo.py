"""The demo's training loop with full telemetry versus the same loop with no metrics at all.

    .venv/bin/python -m bench.bench_demo            # --blocks 6 --steps-per-block 60 --every 10

Two real gloo ranks train the demo's tiny transformer with DDP. Blocks of steps alternate
between the two variants (same model, same data stream), so machine noise hits both alike;
the median steps/s per variant is reported, and the overhead as 1 - telemetry / bare.

"With telemetry" is everything on: the demo's metrics updated every step, the built-in
signals, a collection every `--every` steps, and exporters to a Prometheus endpoint, an
OTLP/HTTP receiver on loopback, W&B offline and a JSONL file.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from tests.distributed import run_ranks
from tests.receivers import OtlpHttpReceiver
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from torchtelemetry.demo import (
    DemoConfig,
    TinyLM,
    build_metrics,
    learning_rate_at,
    synthetic_batch,
    train_step,
    update_metrics,
)


def _exporters(names: list[str], otlp_endpoint: str, workdir: str) -> list[Any]:
    os.environ.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
        WANDB_DIR=workdir,
        WANDB_SILENT="true",
        WANDB_MODE="offline",
    )
    build = {
        "prometheus": lambda: tt.PrometheusExporter(port=0),
        "otlp": tt.OTelExporter,
        "wandb": lambda: tt.WandbExporter(project="bench"),
        "jsonl": lambda: tt.JsonlExporter(os.path.join(workdir, "metrics.jsonl")),
    }
    return [build[name]() for name in names]


def _rank(rank: int, world_size: int, args: argparse.Namespace, otlp_endpoint: str, workdir: str) -> Any:
    torch.set_num_threads(1)
    config = DemoConfig(steps=args.blocks * args.steps_per_block * 2, every=args.every)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(config.vocab, config.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(rank)
    metrics = build_metrics()
    exporters = _exporters(args.exporters, otlp_endpoint, workdir)
    telemetry = tt.Telemetry(metrics, exporters, every=args.every, run_id="bench")

    rates: dict[str, list[float]] = {"bare": [], "telemetry": []}
    step = 0
    for block in range(2 * args.blocks + 2):  # the first pair warms up
        variant = "telemetry" if block % 2 else "bare"
        start = time.perf_counter()
        for _ in range(args.steps_per_block):
            learning_rate = learning_rate_at(config, step)
            result = train_step(
                model, optimizer, synthetic_batch(generator, config, torch.device("cpu")), learning_rate
            )
            if variant == "telemetry":
                update_metrics(metrics, result)
                telemetry.step(
                    step, tokens=result.tokens, samples=config.batch_size, learning_rate=learning_rate
                )
            step += 1
        torch.distributed.barrier()
        if block >= 2:
            rates[variant].append(args.steps_per_block / (time.perf_counter() - start))
    telemetry.close()
    health = {name: (h.exported_reports, h.errors) for name, h in telemetry.hub.health().items()}
    return rates, health


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6, help="measured blocks per variant")
    parser.add_argument("--steps-per-block", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--exporters",
        type=lambda text: [name for name in text.split(",") if name],
        default=["prometheus", "otlp", "wandb", "jsonl"],
        help="comma-separated subset of prometheus,otlp,wandb,jsonl ('' for none)",
    )
    args = parser.parse_args()
    with OtlpHttpReceiver() as receiver, tempfile.TemporaryDirectory() as workdir:
        results = run_ranks(_rank, 2, args, receiver.endpoint, workdir, timeout_s=3600)
        received = len(receiver.received)
    rates, health = results[0]
    bare, full = statistics.median(rates["bare"]), statistics.median(rates["telemetry"])
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(
        f"2 gloo ranks, {args.blocks} blocks x {args.steps_per_block} steps per variant, every {args.every}"
    )
    print("| variant | steps/s (median) | blocks |")
    print("|---|---|---|")
    print(f"| no metrics | {bare:.2f} | {', '.join(f'{r:.1f}' for r in rates['bare'])} |")
    print(f"| full telemetry | {full:.2f} | {', '.join(f'{r:.1f}' for r in rates['telemetry'])} |")
    print(f"overhead: {100 * (1 - full / bare):+.2f} %")
    print(f"exporters (reports, errors): {health}; OTLP requests received: {received}")


if __name__ == "__main__":
    main()
