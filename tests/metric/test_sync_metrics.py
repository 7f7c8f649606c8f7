"""`sync_metrics` and `Metric.sync()` (torchtelemetry.metric) on real gloo ranks: exact global states in
one collective per bucket, ranks with different metric sets, DeviceMesh groups, distributed
checkpoints."""

from __future__ import annotations

import re
import tempfile

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.ops import OpCounter
from tests.sync.collectives import CollectiveCounter

# -- a mixed tree of metrics with every op, fed rank-dependent integer-valued data --------------------


def _mixed_tree(count: int) -> dict[str, dict[str, tt.Metric]]:
    """`count` metrics cycling through every built-in (SUM, MAX and MIN states)."""
    makers = [
        lambda: tt.SumMetric(kind="counter"),
        tt.WeightedMeanMetric,
        tt.MaxMetric,
        tt.MinMetric,
        lambda: tt.HistogramMetric([-2.0, 0.0, 3.0]),
        lambda: tt.AccuracyMetric(top_k=2),
        lambda: tt.ConfusionMatrixMetric(3),
        lambda: tt.BinaryAUROCMetric(num_bins=16),
    ]
    tree: dict[str, dict[str, tt.Metric]] = {"train": {}, "eval": {}}
    for index in range(count):
        tree["train" if index % 2 else "eval"][f"m{index:03d}"] = makers[index % len(makers)]()
    return tree


def _feed(tree: dict[str, dict[str, tt.Metric]], rank: int) -> dict[str, np.ndarray]:
    """Rank-dependent data (integer-valued, so sums are exact in any order); returns what was fed."""
    rng = np.random.default_rng(100 + rank)
    fed: dict[str, np.ndarray] = {}
    for group in tree.values():
        for name, metric in group.items():
            x = rng.integers(-5, 6, size=8).astype(np.float64)
            fed[name] = x
            if isinstance(metric, tt.WeightedMeanMetric):
                metric.update(torch.from_numpy(x), torch.from_numpy(np.abs(x) + rank))
            elif isinstance(metric, tt.SumMetric):
                metric.update(torch.from_numpy(np.abs(x)))
            elif isinstance(metric, (tt.MaxMetric, tt.MinMetric, tt.HistogramMetric)):
                metric.update(torch.from_numpy(x))
            elif isinstance(metric, tt.AccuracyMetric):
                metric.update(
                    torch.from_numpy(rng.permuted(np.tile(np.arange(4.0), (8, 1)), axis=1)),
                    torch.from_numpy(rng.integers(0, 4, size=8)),
                )
            elif isinstance(metric, tt.ConfusionMatrixMetric):
                metric.update(
                    torch.from_numpy(rng.integers(0, 3, size=8)), torch.from_numpy(rng.integers(0, 3, size=8))
                )
            else:
                metric.update(torch.from_numpy((x + 5) / 10), torch.from_numpy((x > 0).astype(np.int64)))
    return fed


# Results cross the process boundary as numpy arrays and Python values (tensors would travel as
# shared-memory handles that die with the rank's process).


def _locals(tree) -> dict[str, np.ndarray]:
    return {name: acc.local.numpy().copy() for name, acc in tt.metric.named_accumulators(tree).items()}


def _synced(tree) -> dict[str, np.ndarray]:
    return {name: acc.value.numpy().copy() for name, acc in tt.metric.named_accumulators(tree).items()}


def _tree_rank(rank: int, world_size: int, count: int) -> dict:
    counter = CollectiveCounter()
    tree = _mixed_tree(count)
    fed = _feed(tree, rank)
    with counter.counting() as first:
        tt.sync_metrics(tree)
    first_sync = dict(first)
    synced_once = _synced(tree)
    steady = []
    for _ in range(3):
        with counter.counting() as calls:
            tt.sync_metrics(tree)
        steady.append(dict(calls))
    # Metric.sync() is the one-metric case of the same code: one collective per bucket.
    single = tree["train"]["m001"]  # a WeightedMeanMetric: one SUM bucket
    single.sync()
    with counter.counting() as calls:
        single.sync()
    mean_name = "m001"
    return {
        "locals": _locals(tree),
        "synced": synced_once,
        "synced_again": _synced(tree),
        "first_sync": first_sync,
        "steady": steady,
        "single_sync": dict(calls),
        "mean": single.compute().item(),
        "mean_fed": fed[mean_name],
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world_size", "count"), [(2, 128), (4, 104)])
def test_every_rank_holds_the_exact_global_state_with_two_collectives(world_size: int, count: int) -> None:
    results = run_ranks(_tree_rank, world_size, count, timeout_s=200)
    names = list(results[0]["locals"])
    assert len(names) >= count  # every metric holds one or more states
    ops = {name: acc.reduce_op for name, acc in tt.metric.named_accumulators(_mixed_tree(count)).items()}
    assert {op.value for op in ops.values()} == {"sum", "max", "min"}
    for name in names:
        stacked = np.stack([result["locals"][name] for result in results])
        expected = {"sum": stacked.sum(0), "max": stacked.max(0), "min": stacked.min(0)}[ops[name].value]
        for rank, result in enumerate(results):
            np.testing.assert_array_equal(result["synced"][name], expected, err_msg=f"{name} rank {rank}")
            np.testing.assert_array_equal(
                result["synced_again"][name], expected, err_msg=f"{name} rank {rank}"
            )
    for result in results:
        # The first sync on a group adds one small layout check; then one all_reduce per bucket (SUM, MAX).
        assert result["first_sync"] == {"all_reduce": 3}
        assert result["steady"] == [{"all_reduce": 2}] * 3
        assert result["single_sync"] == {"all_reduce": 1}
    # An independent check of one metric: the weighted mean of every rank's data.
    values = np.concatenate([r["mean_fed"] for r in results])
    weights = np.concatenate([np.abs(r["mean_fed"]) + rank for rank, r in enumerate(results)])
    for result in results:
        assert result["mean"] == pytest.approx(np.average(values, weights=weights), rel=1e-12)


def test_a_sync_reduces_the_packed_states_in_place_and_copies_nothing_back() -> None:
    """Every synchronized state is a view of one packed buffer per bucket, which a sync fills from
    the locals (one `cat` per bucket) and reduces in place: the same ops for 16 and 128 metrics, and
    no per-state write-back (bench/bench_sync.py measures what that saved)."""
    ops = {}
    for count in (16, 128):
        tree = _mixed_tree(count)
        _feed(tree, rank=0)
        tt.sync_metrics(tree)
        with OpCounter() as counter:
            tt.sync_metrics(tree)
        ops[count] = dict(counter.ops)
        for name, values in _synced(tree).items():  # one process: the global state is the local one
            np.testing.assert_array_equal(values, _locals(tree)[name], err_msg=name)
    assert ops[16] == ops[128]
    assert not [name for name in ops[128] if "copy" in name or "split" in name], ops[128]


# -- different metric sets: an error on every rank, never a hang -------------------------------------------


def _mismatch_rank(rank: int, world_size: int, case: str) -> str:
    metrics: dict[str, tt.Metric] = {"loss": tt.WeightedMeanMetric(), "acc": tt.AccuracyMetric()}
    if case == "extra" and rank == 1:
        metrics["grad_norm"] = tt.MaxMetric()
    if case == "shape":
        metrics["hist"] = tt.HistogramMetric([1.0, 2.0] if rank == 0 else [1.0, 2.0, 3.0])
    if case == "dtype":
        metrics["tokens"] = tt.SumMetric(dtype=torch.float64 if rank == 0 else torch.int64)
    if case == "bins":
        metrics["hist"] = tt.HistogramMetric([1.0, 2.0] if rank == 0 else [10.0, 20.0])
    if case == "top_k":
        metrics["acc"] = tt.AccuracyMetric(top_k=1 + 2 * rank)
    try:
        tt.sync_metrics(metrics)
    except tt.sync.LayoutMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("extra", r"rank 1 lacks \[\] and has extra \['grad_norm.extremum'\] vs rank 0"),
        (
            "shape",
            r"'hist.counts' is sum:torch.float64:\[3\] on rank 0 but sum:torch.float64:\[4\] on rank 1",
        ),
        ("dtype", r"'tokens.total' is sum:torch.float64:\[\] on rank 0 but sum:torch.int64:\[\] on rank 1"),
        ("bins", r"'hist' has bins=\[1.0, 2.0\] on rank 0 but bins=\[10.0, 20.0\] on rank 1"),
        ("top_k", r"'acc' has top_k=1 on rank 0 but top_k=3 on rank 1"),
    ],
)
def test_different_metric_sets_raise_on_every_rank(case: str, expected: str) -> None:
    messages = run_ranks(_mismatch_rank, 2, case, timeout_s=120, pg_timeout_s=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"sync_metrics (rank {rank}): ranks hold different metric sets")
        assert re.search(expected, message), message


# -- DeviceMesh: reduce only within one dim --------------------------------------------------------------


def _mesh_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict = {}
    for label, group in [
        ("dp_tuple", (mesh, "dp")),
        ("dp_index", (mesh, 0)),
        ("dp_sub", mesh["dp"]),
        ("tp_sub", mesh["tp"]),
    ]:
        metrics = {"sum": tt.SumMetric(), "max": tt.MaxMetric(), "min": tt.MinMetric()}
        for metric in metrics.values():
            metric.update(torch.tensor(float(rank)))
        tt.sync_metrics(metrics, group=group)
        out[label] = {name: m.compute().item() for name, m in metrics.items()}
    out["reduce_tp"] = tt.sync.reduce({"x": float(rank)}, op="sum", group=mesh["tp"])["x"].item()
    out["gather_dp"] = tt.sync.per_rank({"x": rank}, group=(mesh, "dp"))["x"]
    try:
        tt.sync_metrics(tt.SumMetric(), group=mesh)
    except ValueError as error:
        out["2d_error"] = str(error)
    return out


@pytest.mark.timeout(240)
def test_device_mesh_dims_reduce_only_within_the_dim() -> None:
    results = run_ranks(_mesh_rank, 4, timeout_s=200)
    # Mesh [[0, 1], [2, 3]]: "dp" (dim 0) groups {0, 2} and {1, 3}; "tp" groups {0, 1} and {2, 3}.
    for rank, out in enumerate(results):
        dp_peers = [rank % 2, rank % 2 + 2]
        tp_peers = [rank // 2 * 2, rank // 2 * 2 + 1]
        expected_dp = {"sum": float(sum(dp_peers)), "max": float(max(dp_peers)), "min": float(min(dp_peers))}
        assert out["dp_tuple"] == out["dp_index"] == out["dp_sub"] == expected_dp
        assert out["tp_sub"] == {
            "sum": float(sum(tp_peers)),
            "max": float(max(tp_peers)),
            "min": float(min(tp_peers)),
        }
        assert out["reduce_tp"] == float(sum(tp_peers))
        assert out["gather_dp"] == dp_peers
        assert "sync_metrics: got a 2-D DeviceMesh with dims ('dp', 'tp')" in out["2d_error"]


# -- torch.distributed.checkpoint --------------------------------------------------------------------------


def _checkpoint_rank(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    tree = _mixed_tree(16)
    _feed(tree, rank)
    flat = {name: metric for group in tree.values() for name, metric in group.items()}
    saved_locals = _locals(tree)
    dcp.save(
        {"metrics": {name: metric.state_dict() for name, metric in flat.items()}},
        checkpoint_id=path + "/dict",
    )
    dcp.save(flat, checkpoint_id=path + "/stateful")  # the metrics as (top-level) Stateful objects
    tt.sync_metrics(tree)
    before = {name: m.compute() for name, m in flat.items()}

    restored_dict = _mixed_tree(16)
    flat_dict = {name: metric for group in restored_dict.values() for name, metric in group.items()}
    state = {"metrics": {name: metric.state_dict() for name, metric in flat_dict.items()}}
    dcp.load(state, checkpoint_id=path + "/dict")
    for name, metric in flat_dict.items():
        metric.load_state_dict(state["metrics"][name])

    restored_stateful = _mixed_tree(16)
    flat_stateful = {name: metric for group in restored_stateful.values() for name, metric in group.items()}
    dcp.load(flat_stateful, checkpoint_id=path + "/stateful")

    out = {"saved": saved_locals, "dict": _locals(restored_dict), "stateful": _locals(restored_stateful)}
    tt.sync_metrics(restored_stateful)
    after = {name: m.compute() for name, m in flat_stateful.items()}
    out["computed_equal"] = all(
        torch.equal(before[n], after[n])
        if not isinstance(before[n], dict)
        else all(torch.equal(before[n][k], after[n][k]) for k in before[n])
        for n in before
    )
    return out


@pytest.mark.timeout(240)
def test_distributed_checkpoint_restores_every_ranks_state_exactly() -> None:
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(_checkpoint_rank, 2, path, timeout_s=200)
    # The ranks' states differ: a checkpoint keeping one copy per key would lose one of them.
    saved = [out["saved"]["train/m001.weighted_sum"] for out in results]
    assert not np.array_equal(saved[0], saved[1])
    for out in results:
        for form in ("dict", "stateful"):
            assert out[form].keys() == out["saved"].keys()
            for name in out["saved"]:
                np.testing.assert_array_equal(out[form][name], out["saved"][name], err_msg=f"{form} {name}")
        assert out["computed_equal"]
