"""One rank's training loop: DDP training with its phases timed, its gradient wait measured and its
layers watched, metric updates, `Telemetry`, a checkpoint now and then (goodput), a Ctrl-C all ranks
agree on (`StopOnSignal`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchtelemetry.demo._checkpoint import checkpoint_directory, save_checkpoint
from torchtelemetry.demo._config import DemoConfig, run_directory
from torchtelemetry.demo._console import (
    INTERRUPTED_EXIT_CODE,
    above_the_bar,
    advance,
    print_banner,
    print_summary,
    progress_bar,
)
from torchtelemetry.demo._exporters import build_exporters
from torchtelemetry.demo._model import (
    TinyLM,
    build_metrics,
    flops_per_token,
    learning_rate_at,
    synthetic_batch,
    train_step,
    update_metrics,
)

__all__ = ["train"]


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
    exporters = build_exporters(config, run_id)
    telemetry = tt.Telemetry(
        metrics,
        exporters,
        every=config.every,
        run_id=run_id,
        flops_per_token=flops_per_token(model, config.seq_len),  # TFLOP/s (and MFU on a known GPU)
        window_lines=config.console,
        dump_dir=run_directory(run_id),  # captures and a hung rank's stacks, beside the run's files
        run_config={
            "steps": config.steps,
            "world_size": world_size,
            "lr": config.lr,
            "batch_size": config.batch_size,
        },
    )
    telemetry.watch_gradient_sync(ddp)  # each rank's wait in the all-reduce (train/sync_wait)
    telemetry.watch_layers(ddp)  # each layer's gradient and parameter norms, where a NaN was born
    checkpoints = checkpoint_directory(run_id)
    if rank == 0:
        print_banner(config, telemetry, world_size, device, checkpoints)
    stop = tt.StopOnSignal(every=config.every)
    progress = progress_bar(config, enabled=rank == 0)
    last_step = -1
    with above_the_bar(progress):
        try:
            for step in range(config.steps):
                if stop.agreed():
                    break
                learning_rate = learning_rate_at(config, step)
                with telemetry.data_wait():  # what a DataLoader's next() is in a real loop
                    batch = synthetic_batch(generator, config, device)
                result = train_step(ddp, optimizer, batch, learning_rate, phase=telemetry.phase)
                update_metrics(metrics, result)
                telemetry.step(
                    step, tokens=result.tokens, samples=config.batch_size, learning_rate=learning_rate
                )
                if config.checkpoint_every is not None and (step + 1) % config.checkpoint_every == 0:
                    save_checkpoint(checkpoints, step, ddp, optimizer, telemetry)
                last_step = step
                if config.step_delay_s:
                    time.sleep(config.step_delay_s)
                advance(progress, telemetry)
        finally:
            stop.restore()
            telemetry.close()
    status = INTERRUPTED_EXIT_CODE if stop.signum is not None else 0
    if rank == 0:
        print_summary(telemetry, last_step, status)
    return status


def _agree_on_run_id(run_id: str | None, device: torch.device) -> str:
    from torchtelemetry.export import RunInfo

    chosen = [RunInfo.create(run_id).run_id if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0, device=device)
    return str(chosen[0])
