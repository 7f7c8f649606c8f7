"""A straggler that synchronous training hides from step time is named by its phase times, and
only the straggler: never a rank that waits for it.

Gloo ranks train one DDP model with `watch_gradient_sync`; one rank sleeps inside its forward,
its data wait or its optimizer step. DDP's all-reduce in backward makes every other rank wait
for it, so every rank's step time is the same and the waiting ranks' backward is long; the sync
wait (`train/sync_wait`) measures that wait, so the backward is scored on its own work and only
the slow rank is named, in the report and by RankStraggler (promtool, on the exported series).
A healthy run under a neighbour process that keeps both cores busy names nobody.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.report.promtool_series import rank_straggler_alerts
from torchtelemetry.report.signals import MIN_COST, MIN_NOISE_WINDOWS

pytestmark = pytest.mark.exclusive  # a healthy rank's phase must not look slow: no other test beside it

DELAY_S = 0.06
STEPS = 36
EVERY = 3


def _train(rank: int, world_size: int, path: str, slow: int | None, slow_phase: str) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}}, [tt.JsonlExporter(path)], every=EVERY, run_id="ddp", nvml=False
    )
    telemetry.watch_gradient_sync(model)  # DDP's all-reduce, held by the phase "backward"

    def straggle(phase: str) -> None:
        if rank == slow and phase == slow_phase:
            time.sleep(DELAY_S)  # a slow GPU, a bad host, a slow disk

    for step in range(STEPS):
        with telemetry.data_wait():
            batch = torch.randn(32, 64)
            straggle("data")
        with telemetry.phase("forward"):
            loss = model(batch).pow(2).mean()
            straggle("forward")
        with telemetry.phase("backward"):
            loss.backward()  # DDP's all-reduce: the other ranks wait here for the slow one
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
            straggle("optimizer")
        loss_metric.update(loss.detach(), 32)
        telemetry.step(step)
    telemetry.close()


def _reports(path: Path) -> list[dict[str, Any]]:
    reports = [json.loads(line)["values"] for line in path.read_text().splitlines()]
    assert len(reports) == STEPS // EVERY
    return reports


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slow_phase", ["forward", "data", "optimizer"])
@pytest.mark.parametrize(("world_size", "slow"), [(2, 1), (4, 2)])
def test_ddp_ranks_name_only_the_slow_rank(
    tmp_path: Path, world_size: int, slow: int, slow_phase: str
) -> None:
    path = tmp_path / "metrics.jsonl"
    run_ranks(_train, world_size, str(path), slow, slow_phase, timeout_s=240)
    reports = _reports(path)
    # Step time cannot tell: every rank waits for the slowest every step. Over the run (the first
    # window holds DDP's first-step set-up), not per window: a busy host delays one rank's step()
    # call at a window's edge by tens of milliseconds, which a 3-step window's mean still shows.
    step_times = [
        sum(values["train/step_time"][str(rank)] for values in reports[1:]) for rank in range(world_size)
    ]
    assert max(step_times) / min(step_times) < 1.2, step_times
    for values in reports[1:]:
        # The others wait for it in the all-reduce: it waits least.
        waits = values["train/sync_wait"]
        assert min(waits, key=waits.get) == str(slow)
        assert values["train/straggler/rank"][slow_phase] == slow
    for values in reports[MIN_NOISE_WINDOWS:]:  # the thresholds are known, in two windows
        assert _straggling(values).get(slow_phase) == slow, values
        assert set(values["train/straggler/top_rank"].values()) == {slow}, "a waiting rank is named"
    alerts = rank_straggler_alerts(reports, tmp_path)
    assert alerts == {(slow_phase, slow)}, alerts


def _straggling(values: dict[str, Any]) -> dict[str, int]:
    """Phase -> rank of each phase whose straggler score passes its threshold at a cost of at
    least `MIN_COST` percent of the step."""
    thresholds, costs = values.get("train/straggler/threshold", {}), values["train/straggler/cost"]
    return {
        phase: int(values["train/straggler/rank"][phase])
        for phase, score in values["train/straggler/score"].items()
        if costs[phase] >= MIN_COST and score > thresholds.get(phase, float("inf"))
    }


def _hog(stop: Any) -> None:
    while not stop.is_set():
        sum(range(10000))


@pytest.mark.timeout(300)
def test_a_healthy_run_beside_a_cpu_hog_raises_no_straggler_alert(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    hogs = [context.Process(target=_hog, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for hog in hogs:
        hog.start()
    try:
        run_ranks(_train, 2, str(path), None, "", timeout_s=240)
    finally:
        stop.set()
        for hog in hogs:
            hog.join(timeout=30)
    reports = _reports(path)
    assert rank_straggler_alerts(reports, tmp_path) == set()
    for values in reports[MIN_NOISE_WINDOWS:]:
        straggler = {name: value for name, value in values.items() if name.startswith("train/straggler/")}
        assert "train/straggler/top_rank" not in values, (straggler, values["train/step_time"])


def test_watch_gradient_sync_wants_a_declared_phase_and_a_ddp_model() -> None:
    telemetry = tt.Telemetry({"train": {"loss": tt.WeightedMeanMetric()}}, [], every=2, nvml=False)
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'fwd' is not a declared phase"):
        telemetry.watch_gradient_sync(module, phase="fwd")
    with pytest.raises(
        TypeError, match=r"Linear has no register_comm_hook; pass the DistributedDataParallel"
    ):
        telemetry.watch_gradient_sync(module)
    telemetry.step(0)
    telemetry.close()
    assert "train/sync_wait" not in telemetry.latest  # nothing watched: nothing exported


BACKWARD_S = 0.3


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward sleeps: gradient work that runs while a bucket already launched
    is all-reduced (DDP overlaps the two)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad


class _TwoBuckets(torch.nn.Module):
    """Two 4 MB layers, one DDP bucket each (`bucket_cap_mb=1`); the slow gradient work between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(_SlowBackward.apply(self.first(x)))


def _overlapped_sync_wait(rank: int, world_size: int) -> float:
    model = DistributedDataParallel(_TwoBuckets(), bucket_cap_mb=1)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry({"train": {"loss": loss_metric}}, [], every=2, nvml=False)
    telemetry.watch_gradient_sync(model)
    for step in range(4):
        with telemetry.phase("forward"):
            loss = model(torch.randn(8, 1024)).pow(2).mean()
        with telemetry.phase("backward"):
            loss.backward()
        loss_metric.update(loss.detach(), 8)
        telemetry.step(step)
    telemetry.close()
    return telemetry.latest["train/sync_wait"]["0"]


def test_gradient_work_that_overlaps_the_all_reduce_is_not_counted_as_waiting() -> None:
    """A rank alone waits for nobody. Its last layer's bucket is launched before the 0.3 s of
    gradient work below it; timed from that launch, the sync wait held the 0.3 s of work (on an H200,
    12-18 ms of a 17 ms backward in a world of one). It is timed from the last bucket's launch (all
    gradients computed) to the completion of every bucket: the wait the step is blocked on."""
    (waited,) = run_ranks(_overlapped_sync_wait, 1, timeout_s=120)
    assert 0 < waited < BACKWARD_S


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_sync_wait_times_the_nccl_all_reduce_with_events() -> None:
    from tests.distributed import nccl_world_of_one

    with nccl_world_of_one():
        device = torch.device("cuda", torch.cuda.current_device())
        model = DistributedDataParallel(torch.nn.Linear(1024, 1024).to(device), device_ids=[device.index])
        loss_metric = tt.WeightedMeanMetric().to(device)
        telemetry = tt.Telemetry({"train": {"loss": loss_metric}}, [], every=4, nvml=False)
        telemetry.watch_gradient_sync(model)
        batch = torch.randn(64, 1024, device=device)
        for step in range(8):
            with telemetry.phase("forward"):
                loss = model(batch).pow(2).mean()
            with telemetry.phase("backward"):
                loss.backward()
            loss_metric.update(loss.detach(), 64)
            telemetry.step(step)
        telemetry.close()
    latest = telemetry.latest
    assert 0 < latest["train/sync_wait"]["0"] < latest["train/phases/median"]["backward"] + 1e-3
