"""Restart at another world size (elastic training, a preempted job resumed on fewer nodes): a
`Telemetry.state_dict()` saved with torch.distributed.checkpoint on 4 ranks loads on 2, and 2 on 4;
counter and histogram totals carry over whole, the partial window is dealt out to the new ranks
exactly, and what cannot move (per-rank state) is dropped with a warning (built-in step times)
or refused with an error saying so (a user's PerRankMetric)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.metric import gather_local_states, restore_local_states

EVERY = 3
SAVED_STEPS = range(7)  # windows end at steps 2 and 5; step 6 is the partial window at the save
RESUMED_STEPS = range(7, 12)  # the window of steps 6-8 closes at 8; close() exports 9-11
BINS = [1.0, 4.0]


def _metrics() -> dict[str, tt.Metric]:
    return {
        "loss": tt.WeightedMeanMetric(),
        "tokens": tt.SumMetric(kind="counter"),
        "sizes": tt.HistogramMetric(BINS),
        "peak": tt.MaxMetric(),
    }


def _inputs(rank: int, step: int) -> tuple[float, int, float]:
    """Exactly representable values, different on every rank and step."""
    return (rank + 1) * 0.5 + step, 8 * (rank + 1) + step, float((rank + step) % 6)


def _train(metrics: dict[str, tt.Metric], rank: int, telemetry: tt.Telemetry, steps: range) -> None:
    for step in steps:
        loss, tokens, size = _inputs(rank, step)
        metrics["loss"].update(loss, tokens)
        metrics["tokens"].update(tokens)
        metrics["sizes"].update(size)
        metrics["peak"].update(loss)
        telemetry.step(step)


def _save(rank: int, world_size: int, checkpoint: str, payload_file: str) -> None:
    metrics = _metrics()
    telemetry = tt.Telemetry(metrics, every=EVERY, run_id="elastic")
    _train(metrics, rank, telemetry, SAVED_STEPS)
    dcp.save({"telemetry": telemetry}, checkpoint_id=checkpoint)
    # A user's per-rank metric holding a partial window, saved the same way.
    per_rank = tt.PerRankMetric(world_size, rank)
    per_rank.update(1.0)
    payload = gather_local_states([("ranks", per_rank)])
    if rank == 0:
        Path(payload_file).write_bytes(payload)
    dist.barrier()
    telemetry.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume(rank: int, world_size: int, checkpoint: str, payload_file: str) -> dict[str, Any]:
    records = _Records()
    logging.getLogger("torchtelemetry").addHandler(records)
    metrics = _metrics()
    telemetry = tt.Telemetry(metrics, every=EVERY, run_id="elastic")
    dcp.load({"telemetry": telemetry}, checkpoint_id=checkpoint)
    windows = []
    for step in RESUMED_STEPS:
        _train(metrics, rank, telemetry, range(step, step + 1))
        if step == 8:
            telemetry.flush()
            windows.append(dict(telemetry.latest))
    telemetry.close()
    try:
        restore_local_states([("ranks", tt.PerRankMetric(world_size, rank))], Path(payload_file).read_bytes())
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "window_6_8": windows[0],
        "final": dict(telemetry.latest),
        "warnings": records.messages,
        "refused": refused,
    }


def _expected(saved_world: int, resumed_world: int) -> dict[str, Any]:
    """What an uninterrupted run would report: the window of steps 6-8 and the final totals."""
    rows = [(rank, step) for rank in range(saved_world) for step in SAVED_STEPS]
    rows += [(rank, step) for rank in range(resumed_world) for step in RESUMED_STEPS]
    window = [(r, s) for r, s in rows if 6 <= s <= 8]
    weighted = sum(_inputs(r, s)[0] * _inputs(r, s)[1] for r, s in window)
    weight = sum(_inputs(r, s)[1] for r, s in window)
    sizes = [_inputs(r, s)[2] for r, s in rows]
    return {
        "loss_6_8": weighted / weight,
        "peak_6_8": max(_inputs(r, s)[0] for r, s in window),
        "tokens": float(sum(_inputs(r, s)[1] for r, s in rows)),
        "sizes_counts": [
            sum(v <= BINS[0] for v in sizes),
            sum(BINS[0] < v <= BINS[1] for v in sizes),
            sum(v > BINS[1] for v in sizes),
        ],
        "sizes_sum": sum(sizes),
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved_world", "resumed_world"), [(4, 2), (2, 4)])
def test_a_checkpoint_loads_at_another_world_size_with_totals_and_the_partial_window(
    tmp_path: Path, saved_world: int, resumed_world: int
) -> None:
    checkpoint, payload = str(tmp_path / "checkpoint"), str(tmp_path / "per_rank.pt")
    run_ranks(_save, saved_world, checkpoint, payload, timeout_s=150)
    results = run_ranks(_resume, resumed_world, checkpoint, payload, timeout_s=150)
    expected = _expected(saved_world, resumed_world)
    for result in results:
        window, final = result["window_6_8"], result["final"]
        assert window["loss"] == pytest.approx(expected["loss_6_8"], rel=1e-12)
        assert window["peak"] == expected["peak_6_8"]
        assert final["tokens"] == expected["tokens"]
        assert list(final["sizes"].counts) == expected["sizes_counts"]
        assert final["sizes"].sum == expected["sizes_sum"]
        assert "cannot be carried over from" in result["refused"]
        assert f"from {saved_world} to {resumed_world} ranks" in result["refused"]
    # The built-in per-rank signals of the partial window (step time, data wait) are dropped, and
    # said so on every rank.
    assert all(any("'train/step_time'" in m and "is dropped" in m for m in r["warnings"]) for r in results)
