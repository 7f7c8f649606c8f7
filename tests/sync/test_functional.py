"""The functional reductions of torchtelemetry.sync (`reduce`, `reduce_custom`, `all_gather`,
`per_rank`) on real gloo ranks: exact, packed into one collective per bucket."""

from __future__ import annotations

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.sync.collectives import CollectiveCounter


def _plain(tree: dict) -> dict:
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in tree.items()}


# -- functional reductions ---------------------------------------------------------------------------------


def _functional_rank(rank: int, world_size: int) -> dict:
    counter = CollectiveCounter()
    values = {
        "loss": torch.tensor(1.0 + rank, dtype=torch.float64),
        "grad_norm": torch.tensor([float(rank), 10.0 - rank]),
        "samples": 10 * (rank + 1),
        "lr": 0.5 * (rank + 1),
    }
    ops = {"loss": "mean", "grad_norm": "max", "samples": "sum", "lr": "min"}
    out: dict = {}
    with counter.counting() as calls:
        out["custom_first"] = _plain(tt.sync.reduce_custom(values, ops))
    out["custom_first_calls"] = dict(calls)
    with counter.counting() as calls:
        out["custom"] = _plain(tt.sync.reduce_custom(values, ops))
    out["custom_calls"] = dict(calls)
    with counter.counting() as calls:
        out["mean"] = _plain(tt.sync.reduce({"loss": values["loss"], "lr": values["lr"]}, op="mean"))
        out["max"] = _plain(tt.sync.reduce({"loss": values["loss"], "lr": values["lr"]}, op="max"))
    out["reduce_calls"] = dict(calls)
    tt.sync.all_gather(values)
    with counter.counting() as calls:
        out["gathered"] = _plain(tt.sync.all_gather(values))
    out["gather_calls"] = dict(calls)
    out["per_rank"] = tt.sync.per_rank({"loss": values["loss"], "samples": values["samples"]})
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_functional_reductions_are_exact_with_packed_collectives(world_size: int) -> None:
    results = run_ranks(_functional_rank, world_size, timeout_s=200)
    ranks = range(world_size)
    for out in results:
        for key in ("custom_first", "custom"):
            assert out[key]["loss"] == sum(1.0 + r for r in ranks) / world_size
            assert out[key]["grad_norm"] == [world_size - 1.0, 10.0]
            assert out[key]["samples"] == sum(10 * (r + 1) for r in ranks)
            assert out[key]["lr"] == 0.5
        # float64 SUM, float32 MAX, float64 MAX (lr via MIN folded into MAX), int64 SUM: 4 buckets.
        assert out["custom_first_calls"] == {"all_reduce": 5}  # + the first layout check
        assert out["custom_calls"] == {"all_reduce": 4}
        assert out["mean"]["lr"] == pytest.approx(0.5 * sum(r + 1 for r in ranks) / world_size)
        assert out["max"]["loss"] == float(world_size)
        assert sum(out["reduce_calls"].values()) == 4  # 2 calls x (layout check + 1 float64 bucket)
        assert out["gathered"]["loss"] == [1.0 + r for r in ranks]
        assert out["gathered"]["grad_norm"] == [[float(r), 10.0 - r] for r in ranks]
        assert out["gathered"]["samples"] == [10 * (r + 1) for r in ranks]
        assert sum(out["gather_calls"].values()) == 3  # one all-gather per dtype (float64, float32, int64)
        assert out["per_rank"] == {"loss": [1.0 + r for r in ranks], "samples": [10 * (r + 1) for r in ranks]}
