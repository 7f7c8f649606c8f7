"""`MetricAccumulator` and the `Metric` base: semantics, storage stability, property tests."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("hypothesis")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

from hypothesis import given, settings
from hypothesis import strategies as st

import torchtelemetry as tt
from torchtelemetry import MetricAccumulator
from torchtelemetry.metric import ReduceOp


def test_update_reset_sync_value() -> None:
    acc = MetricAccumulator(torch.zeros(3), "sum")
    acc.update(torch.tensor([1.0, 2.0, 3.0]))
    acc.update(1.0)  # broadcast over the state
    assert acc.local.tolist() == [2.0, 3.0, 4.0]
    # One process: the local state is the global one, `value` reads it with or without sync().
    assert acc.value.tolist() == [2.0, 3.0, 4.0]
    acc.sync()  # no process group: a local copy
    assert acc.value.tolist() == [2.0, 3.0, 4.0]
    acc.reset()
    assert acc.local.tolist() == [0.0, 0.0, 0.0]
    assert acc.value.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("op", "start", "expected"), [("max", -np.inf, 5.0), ("min", np.inf, -2.0)])
def test_extremum_accumulators(op: str, start: float, expected: float) -> None:
    acc = MetricAccumulator(start, op, dtype=torch.float64)
    for value in [1.0, 5.0, -2.0, 3.0]:
        acc.update(torch.tensor(value))
    assert acc.local.item() == expected
    assert acc.reduce_op is ReduceOp(op)


def test_local_storage_is_kept_across_updates_resets_and_loads() -> None:
    acc = MetricAccumulator(torch.zeros(4), ReduceOp.MAX)
    local_ptr, synced_ptr = acc.local.data_ptr(), acc.value.data_ptr()
    acc.update(torch.arange(4.0))
    acc.sync()
    acc.reset()
    acc.load_state_dict({"local": torch.ones(4)})
    assert acc.local.data_ptr() == local_ptr
    assert acc.value.data_ptr() == synced_ptr
    metric = tt.HistogramMetric([1.0, 2.0])
    pointers = {name: a.local.data_ptr() for name, a in metric.accumulators.items()}
    metric.update(torch.tensor([0.5, 1.5, 9.0]))
    metric.sync()
    metric.reset()
    assert {name: a.local.data_ptr() for name, a in metric.accumulators.items()} == pointers
    assert metric.counts.local.tolist() == [0.0, 0.0, 0.0]


def test_to_moves_every_tensor() -> None:
    acc = MetricAccumulator(torch.zeros(2), "sum").to("meta")
    assert acc.local.device.type == acc.value.device.type == acc.initial.device.type == "meta"
    metric = tt.HistogramMetric([1.0]).to("meta")
    assert metric.device.type == "meta" and metric.bounds.device.type == "meta"


def test_state_dict_and_shape_checks() -> None:
    acc = MetricAccumulator(torch.zeros(2, 2), "sum")
    acc.update(torch.eye(2))
    saved = acc.state_dict()
    other = MetricAccumulator(torch.zeros(2, 2), "sum")
    other.load_state_dict(saved)
    assert torch.equal(other.local, torch.eye(2))
    with pytest.raises(
        ValueError, match=r"MetricAccumulator: saved state has shape \(4,\), expected \(2, 2\)"
    ):
        other.load_state_dict({"local": torch.zeros(4)})
    with pytest.raises(ValueError, match="no 'local' entry"):
        other.load_state_dict({})
    assert torch.equal(other.local, torch.eye(2))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_unsigned_states_are_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="cannot be reduced by negation"):
        MetricAccumulator(0, "sum", dtype=dtype)


def test_metric_registers_accumulators_like_parameters() -> None:
    class Ratio(tt.Metric):
        def __init__(self) -> None:
            super().__init__(name="ratio")
            self.hits = MetricAccumulator(0, "sum", dtype=torch.float64)
            self.seen = MetricAccumulator(0, "sum", dtype=torch.float64)
            self.scratch = torch.zeros(1)  # a plain tensor: not state

        def update(self, hits: torch.Tensor, seen: torch.Tensor) -> None:
            self.hits.update(hits)
            self.seen.update(seen)

        def compute(self) -> torch.Tensor:
            return self.hits.value / self.seen.value

    metric = Ratio()
    assert list(metric.accumulators) == ["hits", "seen"]
    metric.update(torch.tensor(3.0), torch.tensor(4.0))
    metric.sync()
    assert metric.compute().item() == 0.75
    assert set(metric.state_dict()) == {"hits", "seen"}
    metric.seen = None  # replacing an accumulator unregisters it
    assert list(metric.accumulators) == ["hits"]


# -- property tests --------------------------------------------------------------------------------

OPS = st.sampled_from([ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN])
SHAPES = st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple)


@settings(max_examples=60, deadline=None)
@given(op=OPS, shape=SHAPES, data=st.data())
def test_accumulator_matches_a_python_fold(op: ReduceOp, shape: tuple[int, ...], data) -> None:
    size = int(np.prod(shape)) if shape else 1
    steps = data.draw(
        st.lists(st.lists(st.integers(-1000, 1000), min_size=size, max_size=size), min_size=0, max_size=8)
    )
    start = {ReduceOp.SUM: 0.0, ReduceOp.MAX: -np.inf, ReduceOp.MIN: np.inf}[op]
    acc = MetricAccumulator(torch.full(shape, start, dtype=torch.float64), op)
    expected = [start] * size
    fold = {ReduceOp.SUM: lambda a, b: a + b, ReduceOp.MAX: max, ReduceOp.MIN: min}[op]
    for step in steps:
        acc.update(torch.tensor(step, dtype=torch.float64).reshape(shape))
        expected = [fold(a, b) for a, b in zip(expected, step, strict=True)]
    assert acc.local.reshape(-1).tolist() == expected
    acc.reset()
    assert acc.local.reshape(-1).tolist() == [start] * size


def _merge(op: ReduceOp, states: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(states)
    return {ReduceOp.SUM: stacked.sum(0), ReduceOp.MAX: stacked.amax(0), ReduceOp.MIN: stacked.amin(0)}[op]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(-(10**6), 10**6), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_splitting_a_stream_of_updates_and_merging_states_gives_the_same_totals(values, cuts) -> None:
    """Whatever way a stream is split over windows or ranks, merging the states gives one-stream totals."""
    bounds = sorted({0, len(values), *(min(c, len(values)) for c in cuts)})
    pieces = [values[a:b] for a, b in itertools.pairwise(bounds)] or [[]]

    def run(chunk: list[int]) -> dict[str, tt.Metric]:
        metrics = {
            "sum": tt.SumMetric(),
            "mean": tt.WeightedMeanMetric(),
            "max": tt.MaxMetric(),
            "min": tt.MinMetric(),
            "hist": tt.HistogramMetric([-1000.0, 0.0, 1000.0]),
            "cm": tt.ConfusionMatrixMetric(3),
        }
        for value in chunk:
            x = torch.tensor([float(value)], dtype=torch.float64)
            metrics["sum"].update(x)
            metrics["mean"].update(x, abs(value) % 7)
            metrics["max"].update(x)
            metrics["min"].update(x)
            metrics["hist"].update(x)
            metrics["cm"].update(torch.tensor([value % 3]), torch.tensor([(value // 3) % 3]))
        return metrics

    whole = run(values)
    parts = [run(piece) for piece in pieces]
    for name, metric in whole.items():
        for attr, acc in metric.accumulators.items():
            merged = _merge(acc.reduce_op, [part[name].accumulators[attr].local for part in parts])
            assert torch.equal(merged, acc.local), f"{name}.{attr}"
