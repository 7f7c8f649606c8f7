"""`BucketLayout` pack/unpack and local (no process group) sync, as property tests."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("hypothesis")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

from hypothesis import given, settings
from hypothesis import strategies as st

import torchtelemetry as tt
from torchtelemetry.sync import BucketLayout, ReduceOp, resolve_group

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64]


@st.composite
def entries(draw) -> list[tuple[str, torch.Tensor, ReduceOp]]:
    count = draw(st.integers(0, 12))
    out = []
    for index in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        op = draw(st.sampled_from(list(ReduceOp)))
        if dtype.is_floating_point:
            tensor = torch.randn(shape, dtype=torch.float64).mul(100).to(dtype)
        else:
            info = torch.iinfo(dtype)
            # The full range, extremes included: MIN of integers must not overflow.
            tensor = torch.randint(info.min, info.max, shape, dtype=torch.int64).to(dtype)
            if tensor.numel():
                tensor.view(-1)[0] = draw(st.sampled_from([info.min, info.max, 0, -1]))
        out.append((f"m{index}.state", tensor, op))
    return out


@settings(max_examples=80, deadline=None)
@given(layout_entries=entries())
def test_pack_unpack_round_trip(layout_entries) -> None:
    layout = BucketLayout(layout_entries)
    tensors = [tensor for _, tensor, _ in layout_entries]
    buffers = layout.pack(tensors)
    # One buffer per (op, dtype, device); MIN shares the MAX buffer.
    expected_keys = {
        ("max" if op is ReduceOp.MIN else op.value, str(tensor.dtype)) for _, tensor, op in layout_entries
    }
    assert {(key.op, key.dtype) for key in buffers} == expected_keys
    assert layout.buckets == sorted(buffers)
    for key, buffer in buffers.items():
        assert buffer.dim() == 1 and buffer.numel() == layout.size(key) and str(buffer.dtype) == key.dtype
    snapshot = {key: buffer.clone() for key, buffer in buffers.items()}
    for original, restored in zip(tensors, layout.unpack(buffers), strict=True):
        assert restored.dtype == original.dtype and torch.equal(restored, original)
    assert all(torch.equal(snapshot[key], buffers[key]) for key in buffers)  # unpack leaves buffers alone
    into = {key: torch.empty_like(buffer) for key, buffer in buffers.items()}
    layout.pack_into(tensors, into)  # what a sync reduces in place
    assert all(torch.equal(into[key], buffers[key]) for key in buffers)


@given(layout_entries=entries())
def test_entries_kept_in_flat_storage_pack_like_separate_tensors(layout_entries) -> None:
    layout = BucketLayout(layout_entries)
    tensors = [tensor for _, tensor, _ in layout_entries]
    storage = layout.storage(tensors)
    views = layout.views(storage)
    for original, view in zip(tensors, views, strict=True):
        assert view.shape == original.shape and torch.equal(view, original)
        assert any(
            view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in storage.values()
        )
    packed = layout.pack(tensors)
    from_storage = layout.negate_min_({key: buffer.clone() for key, buffer in storage.items()})
    assert all(torch.equal(packed[key], from_storage[key]) for key in packed)
    assert all(torch.equal(view, original) for view, original in zip(views, tensors, strict=True))


@settings(max_examples=60, deadline=None)
@given(layout_entries=entries(), ranks=st.integers(2, 4))
def test_reducing_packed_buffers_equals_reducing_each_tensor(layout_entries, ranks) -> None:
    """Simulated ranks: elementwise max of packed MAX buffers gives MIN back for the negated entries."""
    layout = BucketLayout(layout_entries)
    per_rank = []
    for rank in range(ranks):
        generator = torch.Generator().manual_seed(rank)
        tensors = []
        for _, tensor, _ in layout_entries:
            noise = torch.randint(-50, 50, tensor.shape, generator=generator)
            tensors.append(tensor if rank == 0 else (tensor.to(torch.float64) * 0 + noise).to(tensor.dtype))
        per_rank.append(tensors)
    packed = [layout.pack(tensors) for tensors in per_rank]
    reduced = {}
    for key in layout.buckets:
        stacked = torch.stack([buffers[key] for buffers in packed])
        reduced[key] = stacked.amax(0) if key.op == "max" else stacked.sum(0, dtype=stacked.dtype)
    for index, restored in enumerate(layout.unpack(reduced)):
        _, _, op = layout_entries[index]
        stacked = torch.stack([tensors[index] for tensors in per_rank])
        expected = {
            ReduceOp.SUM: lambda s: s.sum(0, dtype=s.dtype),
            ReduceOp.MAX: lambda s: s.amax(0),
            ReduceOp.MIN: lambda s: s.amin(0),
        }[op](stacked)
        assert torch.equal(restored, expected), layout.names[index]


def test_layout_signature_names_states_ops_dtypes_and_shapes() -> None:
    a = BucketLayout(
        [("loss.total", torch.zeros(()), ReduceOp.SUM), ("lr.extremum", torch.zeros(3), ReduceOp.MIN)]
    )
    b = BucketLayout(
        [("loss.total", torch.zeros(()), ReduceOp.SUM), ("lr.extremum", torch.zeros(4), ReduceOp.MIN)]
    )
    assert a.signature == "loss.total:sum:torch.float32:[];lr.extremum:min:torch.float32:[3]"
    assert a.signature_hash() != b.signature_hash()
    assert (
        a.signature_hash()
        == BucketLayout(
            [
                (n, torch.ones(s), o)
                for n, s, o in [("loss.total", (), ReduceOp.SUM), ("lr.extremum", (3,), ReduceOp.MIN)]
            ]
        ).signature_hash()
    )
    with pytest.raises(TypeError, match="x: MIN reduction needs a signed dtype"):
        BucketLayout([("x", torch.zeros(2, dtype=torch.uint8), ReduceOp.MIN)])


def test_sync_without_process_group_is_a_local_copy() -> None:
    metrics = {"train": {"loss": tt.WeightedMeanMetric(), "best": tt.MinMetric()}, "steps": [tt.SumMetric()]}
    metrics["train"]["loss"].update(torch.tensor([1.0, 3.0]))
    metrics["train"]["best"].update(torch.tensor([4.0, -2.0]))
    metrics["steps"][0].update(7)
    assert tt.sync_metrics(metrics) is None
    assert metrics["train"]["loss"].compute().item() == 2.0
    assert metrics["train"]["best"].compute().item() == -2.0
    assert metrics["steps"][0].compute().item() == 7.0
    metrics["steps"][0].update(1)  # the cached plan sees later updates
    handle = tt.sync_metrics(metrics, async_op=True)
    handle.wait()
    assert metrics["steps"][0].compute().item() == 8.0


def test_sync_sees_metrics_moved_or_replaced_after_a_first_sync() -> None:
    metrics = {"a": tt.SumMetric(), "b": tt.MaxMetric()}
    tt.sync_metrics(metrics)
    metrics["a"] = tt.SumMetric()  # same structure, new object
    metrics["a"].update(5)
    tt.sync_metrics(metrics)
    assert metrics["a"].compute().item() == 5
    metrics["a"].total = tt.MetricAccumulator(10, "sum", dtype=torch.float64)  # a new accumulator
    tt.sync_metrics(metrics)
    assert metrics["a"].compute().item() == 10
    metrics["c"] = tt.MinMetric()  # a new key
    metrics["c"].update(-1)
    tt.sync_metrics(metrics)
    assert metrics["c"].compute().item() == -1


def test_sync_rejects_non_metric_leaves() -> None:
    with pytest.raises(TypeError, match=r"sync_metrics: 'x/0' is a float, expected a Metric"):
        tt.sync_metrics({"x": [1.0]})


@pytest.mark.parametrize("group", ["world", 3, ("not a mesh", 0)])
def test_bad_group_types_list_the_accepted_forms(group) -> None:
    with pytest.raises(TypeError, match=r"sync_metrics: group must be a ProcessGroup, a 1-D DeviceMesh"):
        tt.sync_metrics(tt.SumMetric(), group=group)


def test_functional_reductions_without_process_group_are_local() -> None:
    values = {"loss": 0.1, "samples": torch.tensor(3), "grad_norm": torch.tensor([1.5, 2.5])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_group(None, op="reduce") is None
    out = tt.sync.reduce_custom(values, {"loss": "mean", "samples": "sum", "grad_norm": "max"})
    assert out["loss"].item() == 0.1 and out["loss"].dtype == torch.float64  # Python floats stay doubles
    assert out["samples"].item() == 3 and out["grad_norm"].tolist() == [1.5, 2.5]
    assert tt.sync.per_rank(values) == {"loss": [0.1], "samples": [3], "grad_norm": [[1.5, 2.5]]}
    with pytest.raises(
        ValueError, match=r"reduce_custom: ops must name every value \(no op for \['samples'\]"
    ):
        tt.sync.reduce_custom({"loss": 1.0, "samples": 2}, {"loss": "mean"})
    with pytest.raises(ValueError, match="reduce_custom: unknown ops"):
        tt.sync.reduce({"loss": 1.0}, op="median")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reduce_custom: 'loss' must be a tensor or a number"):
        tt.sync.reduce({"loss": "high"})
