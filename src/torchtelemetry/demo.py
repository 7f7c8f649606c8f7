"""`torchtelemetry demo`: a real multi-process training run wired to every exporter.

Trains a tiny transformer language model on synthetic token data with
DistributedDataParallel (gloo on CPU, NCCL on GPUs). Spawns `--nproc` ranks
itself, or runs unchanged under `torchrun`.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DemoConfig",
    "StepResult",
    "TinyLM",
    "build_metrics",
    "learning_rate_at",
    "main",
    "parse_args",
    "run",
    "synthetic_batch",
    "train_step",
    "update_metrics",
]

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C: the run stopped early, flushed everything and exited cleanly."""


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """What the demo trains and where it exports."""

    nproc: int = 2
    """Ranks to spawn when not launched by torchrun."""
    steps: int = 200
    """Training steps."""
    every: int = 10
    """Collection interval in steps."""
    batch_size: int = 16
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence."""
    vocab: int = 64
    """Vocabulary size of the synthetic language."""
    lr: float = 3e-3
    """Peak learning rate (cosine decay after a short warm-up)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (CUDA when present)."""
    prometheus_port: int | None = 9464
    """Scrape endpoint port on 127.0.0.1 (0 picks a free port; None disables it)."""
    pushgateway: str | None = None
    """Pushgateway URL, e.g. http://127.0.0.1:9091."""
    otlp: str | None = None
    """OTLP base endpoint, e.g. http://127.0.0.1:4318 (HTTP); "" reads the OTEL_* variables."""
    wandb: str | None = None
    """W&B mode: "offline", "online" or "disabled"."""
    jsonl: str | None = None
    """JSONL output path (default runs/<run_id>/metrics.jsonl; "" disables it)."""
    console: bool = True
    """One console line per report."""
    run_id: str | None = None
    """Run id (default: generated)."""
    seed: int = 0
    """Random seed."""
    step_delay_s: float = 0.0
    """Extra host sleep per step, to slow the run down for live viewing."""

    def __post_init__(self) -> None:
        for key in ("nproc", "steps", "every", "batch_size", "seq_len", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"demo.{key} must be at least 1, got {getattr(self, key)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"demo.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.wandb not in (None, "offline", "online", "disabled"):
            raise ValueError(f"demo.wandb must be offline, online or disabled, got {self.wandb!r}")


class TinyLM(nn.Module):
    """A two-layer causal transformer over a small vocabulary."""

    def __init__(self, vocab: int, seq_len: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        size = tokens.shape[1]
        return self.head(self.encoder(hidden, mask=self.mask[:size, :size], is_causal=True))


def synthetic_batch(generator: torch.Generator, config: DemoConfig, device: torch.device) -> torch.Tensor:
    """Sequences that count up by a per-sequence stride: learnable, so the loss falls quickly."""
    start = torch.randint(0, config.vocab, (config.batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (config.batch_size, 1), generator=generator)
    positions = torch.arange(config.seq_len + 1).unsqueeze(0)
    return ((start + stride * positions) % config.vocab).to(device)


def build_metrics(device: torch.device | str = "cpu") -> dict[str, dict[str, Any]]:
    """The demo's metric tree: `train/loss`, `train/accuracy`, `train/grad_norm` (the dashboards' names)."""
    import torchtelemetry as tt

    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(description="Cross-entropy per token"),
            "accuracy": tt.AccuracyMetric(description="Next-token accuracy"),
            "grad_norm": tt.HistogramMetric(
                bins=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10], description="Global gradient norm before clipping"
            ),
        }
    }
    for metric in metrics["train"].values():
        metric.to(device)
    return metrics


def _build_exporters(config: DemoConfig, run_id: str) -> list[Any]:
    from torchtelemetry import export

    exporters: list[Any] = []
    if config.console:
        exporters.append(export.ConsoleExporter(stream=_ProgressSafeStream()))
    if config.prometheus_port is not None:
        exporters.append(export.PrometheusExporter(port=config.prometheus_port))
    if config.pushgateway:
        exporters.append(export.PushgatewayExporter(config.pushgateway))
    if config.otlp is not None:
        if config.otlp:
            # A base endpoint, as the SDK reads it: /v1/metrics is appended for OTLP/HTTP.
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = config.otlp
        exporters.append(export.OTelExporter())
    if config.wandb:
        exporters.append(
            export.WandbExporter(
                project="torchtelemetry-demo", mode=config.wandb, summaries={"train/loss": "min"}
            )
        )
    if config.jsonl != "":
        exporters.append(export.JsonlExporter(config.jsonl or Path("runs") / run_id / "metrics.jsonl"))
    return exporters


class _ProgressSafeStream:
    """Console lines written above the progress bar instead of through it."""

    def write(self, text: str) -> int:
        try:
            from tqdm import tqdm
        except ImportError:
            return sys.stderr.write(text)
        tqdm.write(text.rstrip("\n"), file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step hands to the metrics (device tensors, detached)."""

    loss: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor
    grad_norm: torch.Tensor
    tokens: int


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, learning_rate: float
) -> StepResult:
    """One optimizer step of next-token prediction on `batch` (sequences of `seq_len + 1` tokens)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    vocab = logits.shape[-1]
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    return StepResult(
        loss.detach(),
        logits.detach().reshape(-1, vocab),
        targets.reshape(-1),
        grad_norm.detach(),
        targets.numel(),
    )


def update_metrics(metrics: dict[str, dict[str, Any]], result: StepResult) -> None:
    """Fold one step into the demo's metrics: device-side only, no host sync."""
    metrics["train"]["loss"].update(result.loss, result.tokens)
    metrics["train"]["accuracy"].update(result.logits, result.targets)
    metrics["train"]["grad_norm"].update(result.grad_norm)


def learning_rate_at(config: DemoConfig, step: int) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to zero."""
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


def train(config: DemoConfig, rank: int, world_size: int, device: torch.device) -> int:
    """The training loop of one rank; returns the exit status."""
    import torchtelemetry as tt

    torch.manual_seed(config.seed)
    model = TinyLM(config.vocab, config.seq_len).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed * 1000 + rank)

    metrics = build_metrics(device)
    run_id = _agree_on_run_id(config.run_id, device)
    exporters = _build_exporters(config, run_id)
    telemetry = tt.Telemetry(
        metrics,
        exporters,
        every=config.every,
        run_id=run_id,
        run_config={
            "steps": config.steps,
            "world_size": world_size,
            "lr": config.lr,
            "batch_size": config.batch_size,
        },
    )
    if rank == 0:
        _print_banner(config, telemetry, world_size, device)
    stop = _StopFlag()
    progress = _progress_bar(config, enabled=rank == 0)
    last_step = -1
    status = 0
    try:
        for step in range(config.steps):
            if step % config.every == 0 and stop.agreed(device):
                status = INTERRUPTED_EXIT_CODE
                break
            learning_rate = learning_rate_at(config, step)
            result = train_step(ddp, optimizer, synthetic_batch(generator, config, device), learning_rate)
            update_metrics(metrics, result)
            telemetry.step(step, tokens=result.tokens, samples=config.batch_size, learning_rate=learning_rate)
            last_step = step
            if config.step_delay_s:
                time.sleep(config.step_delay_s)
            _advance(progress, telemetry)
    finally:
        stop.restore()
        telemetry.close()
        if progress is not None:
            progress.close()
    if rank == 0:
        _print_summary(telemetry, last_step, status)
    return status


def _agree_on_run_id(run_id: str | None, device: torch.device) -> str:
    from torchtelemetry.export import RunInfo

    chosen = [RunInfo.create(run_id).run_id if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0, device=device)
    return str(chosen[0])


class _StopFlag:
    """Ctrl-C sets a flag; ranks agree on it every `every` steps so they all stop at the same step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _progress_bar(config: DemoConfig, *, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=config.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _advance(progress: Any, telemetry: Any) -> None:
    if progress is None:
        return
    progress.update(1)
    latest = telemetry.latest
    if "train/loss" in latest:
        progress.set_postfix(
            loss=f"{latest['train/loss']:.3f}",
            tok_s=f"{latest.get('train/tokens_per_second', float('nan')):.0f}",
            refresh=False,
        )


def _print_banner(config: DemoConfig, telemetry: Any, world_size: int, device: torch.device) -> None:
    print(f"torchtelemetry demo: run {telemetry.run.run_id}, {world_size} ranks on {device.type}", flush=True)
    for exporter in telemetry.hub.exporters:
        where = getattr(exporter, "url", None) or getattr(exporter, "path", None)
        if where:
            print(f"  {exporter.name}: {where}", flush=True)
    print("  full stack (Prometheus, Grafana, Collector, Pushgateway): docker compose up -d", flush=True)


def _print_summary(telemetry: Any, last_step: int, status: int) -> None:
    state = "interrupted" if status == INTERRUPTED_EXIT_CODE else "finished"
    print(f"\n{state} after step {last_step}; final window:", flush=True)
    width = max((len(name) for name in telemetry.latest), default=10)
    for name, value in sorted(telemetry.latest.items()):
        if isinstance(value, float):
            text = f"{value:.6g}"
        elif isinstance(value, dict):
            text = ", ".join(f"{label}={v:.4g}" for label, v in value.items())
        else:
            text = f"histogram: count={value.count:.0f}, sum={value.sum:.4g}"
        print(f"  {name:<{width}}  {text}", flush=True)
    for name, health in telemetry.hub.health().items():
        print(
            f"  exporter {name}: {health.exported_reports} reports, {health.errors} errors, "
            f"{health.dropped_reports} dropped",
            flush=True,
        )


def _device_for(config: DemoConfig, local_rank: int) -> torch.device:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # Ranks share the host's cores: one intra-op pool each would oversubscribe them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    return torch.device("cpu")


def _rank_main(local_rank: int, config: DemoConfig, world_size: int, port: int | None) -> int:
    if port is not None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), WORLD_SIZE=str(world_size)
        )
        os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
    device = _device_for(config, local_rank)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120)
    )
    try:
        return train(config, dist.get_rank(), dist.get_world_size(), device)
    finally:
        dist.destroy_process_group()


def _spawned_rank(local_rank: int, config: DemoConfig, world_size: int, port: int) -> None:
    # Exit 0 after a Ctrl-C too: a non-zero exit would make the launcher kill ranks still flushing.
    _rank_main(local_rank, config, world_size, port)


def run(config: DemoConfig) -> int:
    """Run the demo: under torchrun as this rank, else by spawning `config.nproc` ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _rank_main(int(os.environ.get("LOCAL_RANK", "0")), config, int(os.environ["WORLD_SIZE"]), None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(
        _spawned_rank,
        args=(config, config.nproc, port),
        nprocs=config.nproc,
        join=False,
        start_method="spawn",
    )
    interrupted: list[int] = []

    def forward_interrupt(signum: int, frame: Any) -> None:
        """Pass Ctrl-C to every rank (they may not share the terminal, e.g. under a test harness)."""
        interrupted.append(signum)
        for process in context.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward_interrupt)
    try:
        finished = False
        while not finished:  # join() returns False while some rank is still running
            finished = context.join()
    except mp.ProcessExitedException as error:
        print(f"torchtelemetry demo: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return INTERRUPTED_EXIT_CODE if interrupted else 0


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    """Demo flags; environment variables give the defaults where named."""
    env = os.environ
    parser = argparse.ArgumentParser(prog="torchtelemetry demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="collection interval in steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=int(env.get("TORCHTELEMETRY_PROMETHEUS_PORT", "9464")),
        help="scrape endpoint on 127.0.0.1 (0: any free port) [$TORCHTELEMETRY_PROMETHEUS_PORT]",
    )
    parser.add_argument("--no-prometheus", action="store_true", help="no scrape endpoint")
    parser.add_argument(
        "--pushgateway",
        default=env.get("TORCHTELEMETRY_PUSHGATEWAY_URL"),
        help="[$TORCHTELEMETRY_PUSHGATEWAY_URL]",
    )
    parser.add_argument(
        "--otlp",
        default=None,
        help="OTLP endpoint (default: on when $OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is set); "
        "protocol from $OTEL_EXPORTER_OTLP_PROTOCOL",
    )
    parser.add_argument(
        "--wandb",
        choices=["offline", "online", "disabled"],
        default=env.get("TORCHTELEMETRY_WANDB"),
        help="W&B mode",
    )
    parser.add_argument(
        "--jsonl",
        default=env.get("TORCHTELEMETRY_JSONL"),
        help="JSONL path ('' disables; default runs/<run>/)",
    )
    parser.add_argument("--no-console", action="store_true", help="no console line per report")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (live viewing)")
    args = parser.parse_args(argv)
    return DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        every=args.every,
        batch_size=args.batch_size,
        device=args.device,
        prometheus_port=None if args.no_prometheus else args.prometheus_port,
        pushgateway=args.pushgateway,
        otlp=args.otlp if args.otlp is not None else _otlp_from_environment(env),
        wandb=args.wandb,
        jsonl=args.jsonl,
        console=not args.no_console,
        run_id=args.run_id,
        seed=args.seed,
        step_delay_s=args.step_delay,
    )


def _otlp_from_environment(env: Mapping[str, str]) -> str | None:
    """ "" (let the exporter read the OTEL_* variables) when an OTLP endpoint is configured there."""
    configured = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return "" if configured else None


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
