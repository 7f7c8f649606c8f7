"""The health signals never sync a device on the training thread: checked without a GPU by
`tests.hostsync.NoHostSync`, on the "meta" device for their device ops (the sentinel's counting in
`update()`, the per-window writes into the window's state) and on the CPU for the whole loop
(phases, the data wait, a counted update and `step()`, where every read of a value counts)."""

from __future__ import annotations

import pytest
import torch

import torchtelemetry as tt
from tests.hostsync import CPU_ONLY_READS, NoHostSync
from tests.metric.examples import PATHS, on_path
from tests.report.windows import context
from torchtelemetry.report.signals import (
    MemoryHealth,
    NonFiniteSentinel,
    Phases,
    RankValues,
    SignalContext,
    watched_metrics,
)

META = torch.device("meta")


@pytest.mark.parametrize(
    ("factory", "inputs"),
    [
        (tt.WeightedMeanMetric, lambda: (torch.zeros((), device=META), 4096)),
        (tt.WeightedMeanMetric, lambda: (torch.zeros(16, device=META), torch.ones(16, device=META))),
        (tt.SumMetric, lambda: (torch.zeros(8, dtype=torch.float16, device=META),)),
        (tt.MaxMetric, lambda: (torch.zeros(4, device=META),)),
        (tt.SumMetric, lambda: (2.5,)),
    ],
    ids=["weighted mean 0-d", "weighted mean vector", "sum float16", "max", "sum Python float"],
)
@pytest.mark.parametrize("path", PATHS)
def test_counting_non_finite_values_in_update_never_syncs_the_device(factory, inputs, path: str) -> None:
    loss = on_path(factory().to(META), path)
    sentinel = NonFiniteSentinel(
        SignalContext(world_size=4, rank=2, device=META), watched_metrics([("train/loss", loss)], None)
    )
    on_path(sentinel.counts, path)
    arguments = inputs()
    with NoHostSync():
        loss.update(*arguments)
        loss.update(*arguments)
        sentinel.flush(1.0)  # applies what was staged: it reads the counts
    sentinel.close()


@pytest.mark.parametrize("path", PATHS)
def test_the_per_window_writes_into_the_window_state_never_sync_the_device(path: str) -> None:
    """Staged, the window's host values are one host row copied once to the device."""
    phases = Phases(SignalContext(world_size=4, rank=1, device=META), ("forward",))
    on_path(phases.times, path)
    ranks = on_path(RankValues(4, 1, ("a", "b")).to(META), path)
    with NoHostSync():
        phases.times.add([0.25], 3)
        ranks.write(0, 1.5)
        ranks.write(1, 2.5)
        phases.times.steps.apply_staged()
        ranks.values.apply_staged()


def test_a_training_step_with_phases_and_the_sentinel_never_reads_a_value_on_cpu() -> None:
    loss = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry({"train": {"loss": loss}}, every=2, phases=("forward", "backward"))
    memory = MemoryHealth(context())
    try:
        for step in range(4):  # warm-up windows
            loss.update(torch.tensor(2.0), 512)
            telemetry.step(step)
        value, tokens = torch.tensor(float("nan")), torch.tensor(512)
        for step in range(4, 24):
            with NoHostSync(exempt=CPU_ONLY_READS):
                with telemetry.data_wait():
                    pass
                with telemetry.phase("forward"):
                    loss.update(value, tokens)  # counted by the sentinel
                with telemetry.phase("backward"):
                    pass
                telemetry.step(step)
                memory.flush(0.1)
        telemetry.flush()
        assert telemetry.latest["train/nonfinite/count"] == {"train/loss": 20.0}
        assert set(telemetry.latest["train/phases/share"]) == {"data", "forward", "backward"}
    finally:
        telemetry.close()
