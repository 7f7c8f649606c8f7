"""A straggler that synchronous training hides from step time is named by its phase times.

Four gloo ranks train one DDP model; rank 2 is slower inside its forward. DDP's all-reduce in
backward makes every rank wait for it, so every rank's step time is the same, while the phases
show where the time went: rank 2's forward is long, the other ranks' backward is long (they wait).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import run_ranks

SLOW = 2
DELAY_S = 0.04
STEPS = 12
EVERY = 4


def _train(rank: int, world_size: int, path: str) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}}, [tt.JsonlExporter(path)], every=EVERY, run_id="ddp"
    )
    for step in range(STEPS):
        with telemetry.data_wait():
            batch = torch.randn(32, 64)
        with telemetry.phase("forward"):
            loss = model(batch).pow(2).mean()
            if rank == SLOW:
                time.sleep(DELAY_S)  # the straggler: slow inside its forward (a slow GPU, a bad host)
        with telemetry.phase("backward"):
            loss.backward()  # DDP's all-reduce: the fast ranks wait here for the slow one
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        loss_metric.update(loss.detach(), 32)
        telemetry.step(step)
    telemetry.close()


@pytest.mark.timeout(300)
def test_four_ddp_ranks_name_the_rank_slow_in_its_forward_phase(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    run_ranks(_train, 4, str(path), timeout_s=240)
    reports = [json.loads(line)["values"] for line in path.read_text().splitlines()]
    assert len(reports) == STEPS // EVERY
    for values in reports[1:]:  # the first window holds DDP's first-step set-up
        # Step time cannot tell: every rank waits for the slowest every step.
        step_times = values["train/step_time"]
        assert max(step_times.values()) / min(step_times.values()) < 1.2
        # Phases can: the slow rank is named, as a value, in its phase and at the top.
        assert values["train/straggler/rank"]["forward"] == SLOW
        assert values["train/straggler/score"]["forward"] > 2.0
        assert values["train/straggler/top_rank"]["1"] == SLOW
        assert values["train/phases/max_rank"]["forward"] == SLOW
        assert values["train/phases/min_rank"]["backward"] == SLOW  # it waits least in the all-reduce
        assert values["train/phase/forward"][str(SLOW)] >= DELAY_S
        assert set(values["train/phases/share"]) == {"data", "forward", "backward", "optimizer"}
