"""The training loop of the live stack tests: on each rank, a metric tree of `TREES` and every signal a
CPU run can show (a small DDP model whose gradient wait and layers are watched, phases, a durable
checkpoint now and then, every step keyword), until the test says stop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.stack._stack import feed
from tests.step_inputs import step_inputs

TOKENS, SAMPLES = 8 * 16, 8
"""Per rank and step: what `train_until_stopped` feeds `step()`."""
CHECKPOINT_EVERY = 20
"""Steps between the checkpoints marked durable (goodput)."""
RUN_LIMIT_S = 150.0
"""The ranks stop on their own after this long, should the test never tell them to."""


def train_until_stopped(telemetry: Any, tree: str, metrics: dict[str, Any], rank: int, stop_file: str) -> int:
    """Train on this rank with `telemetry` (built on `metrics`, a tree of `TREES[tree]`) until
    `stop_file` exists (every rank stops at the same step); rank 1 is the slower one. Returns the
    steps trained."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    telemetry.watch_gradient_sync(model)  # train/sync_wait
    telemetry.watch_layers(model)  # train/layer/*
    generator = torch.Generator().manual_seed(rank)
    deadline = time.monotonic() + RUN_LIMIT_S
    step = 0
    while True:
        if step % 10 == 0:
            stop = torch.tensor([float(Path(stop_file).exists() or time.monotonic() > deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            if stop.item():
                return step
        with telemetry.data_wait():
            time.sleep(0.002)
            inputs = torch.randn(8, 8, generator=generator)
        with telemetry.phase("forward"):
            loss = model(inputs).square().mean()
            feed(tree, metrics, generator)
        with telemetry.phase("backward"):
            time.sleep(0.001 * (1 + rank))
            optimizer.zero_grad()
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
        telemetry.step(step, **step_inputs(tokens=TOKENS, samples=SAMPLES, learning_rate=1e-3 / (1 + step)))
        if (step + 1) % CHECKPOINT_EVERY == 0:
            telemetry.state_dict()  # what a checkpoint saves beside the model
            telemetry.checkpoint_saved(step)  # train/goodput
        time.sleep(0.02 * (1 + rank))
        step += 1
