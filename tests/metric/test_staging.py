"""Staged updates (`UpdateStage`): a bound metric's updates are checked at `update()`, applied together
in a fixed number of tensor ops, exactly as one by one, before anything reads a state; what cannot be
staged runs at once. Counted and compared, never timed (bench/bench_launches.py times them)."""

from __future__ import annotations

import copy
import math
import pickle
import statistics
import threading
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.metric.examples import EXAMPLES, build, feed, staged
from tests.metric.test_metrics import computed
from tests.ops import OpCounter
from tests.trees import pytree
from torchtelemetry.collect import AsyncMetricCollector
from torchtelemetry.metric import sync_metrics

EVERY = 5
APPLIED = {"in host memory": None, "by ops": 0}
"""How a CPU flush applies a few entries: in the buffer's memory (`HOST_FOLDS` as it is), or by the
ops a device runs (`HOST_FOLDS` 0: the path a GPU takes, checked here on the CPU)."""


@pytest.fixture(params=list(APPLIED), ids=list(APPLIED))
def applied(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test using it runs with both ways of applying a CPU flush (`APPLIED`)."""
    if APPLIED[request.param] is not None:
        monkeypatch.setattr("torchtelemetry.metric._staging.HOST_FOLDS", APPLIED[request.param])
    return request.param


def _pending(metric: tt.Metric) -> int:
    stages = {id(stage): stage for acc in metric.accumulators.values() if (stage := acc.stage) is not None}
    return sum(stage.pending for stage in stages.values())


@pytest.mark.parametrize(("cls", "example"), EXAMPLES)
def test_every_example_staged_ends_in_the_state_of_its_updates_one_by_one(
    cls: type[tt.Metric], example: tt.metric.MetricExample, applied: str
) -> None:
    """Bit for bit: staging changes when an update is applied, not what it adds (float64 arithmetic
    in the order the updates came), whether the flush applies it in host memory or by ops."""
    immediate = feed(build(cls, example), example, times=3)
    bound = feed(staged(build(cls, example)), example, times=3)
    for attr, accumulator in immediate.accumulators.items():
        torch.testing.assert_close(
            bound.accumulators[attr].local, accumulator.local, rtol=0, atol=0, equal_nan=True, msg=attr
        )
    torch.testing.assert_close(computed(bound), computed(immediate), rtol=0, atol=0, equal_nan=True)


def test_a_loss_and_its_token_count_are_staged_and_applied_when_read() -> None:
    metric = staged(tt.WeightedMeanMetric())
    losses = [torch.tensor(float(step)) for step in range(4)]
    half, tokens = torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(3)
    with OpCounter() as counter:
        for loss in losses:
            metric.update(loss, 512)
            metric.update(half, tokens)
    # Checked and staged: no tensor op but the CPU-only read of the weight tensor (not negative).
    assert set(counter.ops) == {"aten._local_scalar_dense.default"}, counter.ops
    assert _pending(metric) == 16
    assert metric.weighted_sum.local.item() == (0 + 1 + 2 + 3) * 512 + 4 * 0.5 * 3
    assert metric.total_weight.local.item() == 4 * 515 and _pending(metric) == 0


def test_a_weight_too_large_for_the_state_is_refused_at_update_and_the_staged_updates_stay() -> None:
    """A Python int beyond 64 bits cannot be staged (the flush would fail on it, taking every update
    staged with it): refused at `update()`, naming the metric, nothing staged lost."""
    metric = staged(tt.WeightedMeanMetric())
    metric.update(torch.tensor(2.0), 3)
    with pytest.raises(
        ValueError, match=r"WeightedMeanMetric: weight=1000\d+ does not fit in a 64-bit integer"
    ):
        metric.update(torch.tensor(1.0), 10**400)
    assert metric.compute().item() == 2.0 and metric.total_weight.local.item() == 3


def _reads() -> dict[str, object]:
    return {
        "local": lambda m: m.weighted_sum.local.clone(),
        "value": lambda m: m.weighted_sum.value.clone(),
        "compute": lambda m: m.compute(),
        "state_dict": lambda m: m.state_dict()["weighted_sum"],
        "sync_metrics": lambda m: (sync_metrics(m), m.weighted_sum.value.clone())[1],
        "deepcopy": lambda m: copy.deepcopy(m).weighted_sum.local.clone(),
        "pickle": lambda m: pickle.loads(pickle.dumps(m)).weighted_sum.local.clone(),
    }


@pytest.mark.parametrize("read", list(_reads()))
def test_every_read_of_a_state_applies_what_was_staged(read: str) -> None:
    metric = staged(tt.WeightedMeanMetric())
    metric.update(torch.tensor(2.0), 3)
    assert _pending(metric) == 2
    assert float(_reads()[read](metric)) in (6.0, 2.0)  # weighted sum, or the mean
    assert _pending(metric) == 0
    metric.update(torch.tensor(4.0), 1)
    metric.reset()  # what was staged before a reset is gone with it
    assert metric.weighted_sum.local.item() == 0 and _pending(metric) == 0


def test_a_tensor_changed_in_place_before_the_flush_raises_naming_the_state() -> None:
    """The stage reads a tensor when it applies it: a loss buffer reused (`loss.zero_()` after the
    update) would be counted as 0. Its version counter says it changed: the flush raises, and drops
    what was staged with it (its value is gone), keeping what was applied before."""
    metric = staged(tt.WeightedMeanMetric(name="train/loss"))
    metric.update(torch.tensor(1.0), 2)
    metric.compute()
    loss = torch.tensor(5.0)
    metric.update(loss, 2)
    loss.zero_()
    with pytest.raises(RuntimeError, match=r"metric.weighted_sum.*modified in place.*value.clone\(\)"):
        metric.compute()
    assert metric.weighted_sum.local.item() == 2.0 and metric.total_weight.local.item() == 2.0


def test_a_staged_state_read_on_another_thread_raises() -> None:
    metric = staged(tt.SumMetric())
    metric.update(torch.tensor(1.5))
    errors: list[BaseException] = []

    def read() -> None:
        try:
            metric.compute()
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=read, name="reader")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "read from thread 'reader'" in str(errors[0])
    assert metric.compute().item() == 1.5  # the training thread reads it


class _Subclass(torch.Tensor):
    """A tensor subclass (as DTensor or a tensor wrapper is), without behaviour of its own."""


@pytest.mark.parametrize(
    ("make", "update"),
    [
        (lambda: tt.WeightedMeanMetric(dtype=torch.float32), lambda m: m.update(torch.tensor(2.0), 3)),
        (lambda: tt.SumMetric(dtype=torch.int64), lambda m: m.update(torch.tensor(3))),
        (tt.SumMetric, lambda m: m.total.update(torch.tensor(2.0, requires_grad=True))),
        (tt.SumMetric, lambda m: m.total.update(torch.tensor(1.0, device="meta"))),
        (lambda: tt.PerRankMetric(2, 1), lambda m: m.sums.update(torch.tensor([1.0, 2.0]))),
        (tt.SumMetric, lambda m: m.total.update(torch.tensor(2.5).as_subclass(_Subclass))),
    ],
    ids=["float32 state", "int64 state", "requires grad", "another device", "a vector", "a subclass"],
)
def test_what_cannot_be_staged_is_applied_at_once(make, update) -> None:
    """Not a float64 state, or not a 0-d `torch.Tensor` of a real dtype on the state's device outside
    autograd (a metric's own update converts and reduces its inputs first; a subclass's own dispatch
    decides what reading it does, so it is added as unbound)."""
    metric = staged(make())
    try:
        update(metric)
    except RuntimeError:  # refused by the op itself, at once, as without a stage
        assert _pending(metric) == 0
        return
    assert _pending(metric) == 0
    reference = make()
    update(reference)
    torch.testing.assert_close(computed(metric), computed(reference), rtol=0, atol=0, equal_nan=True)


def test_an_entry_staged_by_index_lands_where_indexing_puts_it_and_other_indices_run_as_unbound() -> None:
    """A state's entry offsets are kept per index once staged: every int (or tuple of ints) index,
    negative ones too, stages into the entry that indexing selects, again and again; an index of any
    other type (a float, a bool, a slice) is not staged and does what it does unbound (a float is
    refused, naming nothing staged)."""
    metric, reference = staged(tt.PerRankMetric(3, 1)), tt.PerRankMetric(3, 1)
    for _ in range(3):
        for index, value in ((1, 2.0), (-1, 4.0), (0, 0.5), (2, 1.0), (True, 8.0), (slice(0, 2), 16.0)):
            for state in (metric.sums, reference.sums):
                state.add_at(index, value)
    assert _pending(metric) == 12  # the ints staged, 4 a round
    torch.testing.assert_close(metric.sums.local, reference.sums.local, rtol=0, atol=0)
    for state in (metric.sums, reference.sums):
        with pytest.raises(IndexError):
            state.add_at(1.0, 1.0)
    assert _pending(metric) == 0
    torch.testing.assert_close(metric.sums.local, reference.sums.local, rtol=0, atol=0)


@pytest.mark.parametrize("count", [3, 80], ids=["folded in host memory", "past HOST_FOLDS: one op"])
def test_maxima_and_minima_of_python_numbers_end_as_one_by_one_nan_winning(count: int) -> None:
    """On the CPU a few Python numbers (a signal's host values, folded by the accumulator: a metric's
    `update` makes a tensor of them) are folded into the MAX buffer in host memory, no op; more by
    `scatter_reduce_`: either way the states are the unbound ones, bit for bit, NaN winning wherever
    it comes, +-inf and integers as float64 takes them."""
    numbers = [2.5, -math.inf, 7, float("nan"), 1e308, -3, math.inf, 2**53 + 1, 0.1]
    metrics = {"max": tt.MaxMetric(), "min": tt.MinMetric(), "clean": tt.MaxMetric()}
    reference = {name: type(metric)() for name, metric in metrics.items()}
    collector = AsyncMetricCollector(metrics).bind()
    try:
        for at, value in enumerate(numbers):
            with OpCounter() as counter:
                for name in ("max", "min"):
                    for _ in range(count // 2):
                        metrics[name].extremum.update(value)
                        reference[name].extremum.update(value)
                metrics["clean"].extremum.update(float(at))
                reference["clean"].extremum.update(float(at))
                collector.apply_staged()
            assert ("aten.scatter_reduce_.two" in counter.ops) == (count > 32), counter.ops
            for name, metric in metrics.items():
                torch.testing.assert_close(
                    metric.accumulators["extremum"].local,
                    reference[name].accumulators["extremum"].local,
                    rtol=0,
                    atol=0,
                    equal_nan=True,
                    msg=f"{name} after {numbers[: at + 1]}",
                )
    finally:
        collector.unbind()
    assert math.isnan(metrics["max"].compute().item()) and metrics["clean"].compute().item() == 8.0


def test_a_stage_past_its_bound_is_applied_without_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchtelemetry.metric._staging as staging

    monkeypatch.setattr(staging, "MAX_STAGED", 8)
    metric = staged(tt.SumMetric())
    for _ in range(20):
        metric.update(torch.tensor(1.0))
        assert _pending(metric) < 8
    assert metric.compute().item() == 20.0


def test_an_unbound_collector_stops_staging_and_keeps_what_was_staged() -> None:
    metric = tt.WeightedMeanMetric()
    collector = AsyncMetricCollector({"loss": metric}).bind()
    metric.update(torch.tensor(2.0), 4)
    assert _pending(metric) == 2
    collector.unbind()
    assert _pending(metric) == 0 and metric.weighted_sum.local.item() == 8.0
    metric.update(torch.tensor(1.0), 1)
    assert _pending(metric) == 0 and metric.compute().item() == 9.0 / 5.0


def test_a_compiled_update_of_a_bound_metric_runs_in_its_graph() -> None:
    """Inside torch.compile nothing is staged (the update belongs to the graph); eager updates of
    the same bound metric are, and both land in the same state."""
    torch.compiler.reset()
    metric = tt.WeightedMeanMetric()
    collector = AsyncMetricCollector({"loss": metric}).bind()
    try:
        compiled = torch.compile(metric.update, fullgraph=True, backend="aot_eager")
        for step in range(3):
            pending = _pending(metric)
            compiled(torch.tensor(float(step)), torch.tensor(2.0))
            assert _pending(metric) == pending  # in the graph, at once
            metric.update(torch.tensor(1.0), 1)
            assert _pending(metric) == pending + 2
        assert _pending(metric) == 6
        assert metric.weighted_sum.local.item() == (0 + 1 + 2) * 2 + 3
        assert metric.total_weight.local.item() == 3 * 2 + 3
    finally:
        collector.unbind()


def _step_ops(num_means: int) -> tuple[int, int, float]:
    """Median ATen ops of a step (K weighted means updated, `Telemetry.step()`) on the training
    thread, of the steps that end no window and of those that do, and the loss exported."""
    metrics = {f"train/m{i}": tt.WeightedMeanMetric() for i in range(num_means)}
    telemetry = tt.Telemetry(metrics, every=EVERY)
    losses = [torch.tensor(1.0 + i) for i in range(num_means)]
    plain, windows = [], []
    try:
        for step in range(6 * EVERY):
            with OpCounter() as counter:
                for metric, loss in zip(metrics.values(), losses, strict=True):
                    metric.update(loss, 512)
                telemetry.step(step)
            if step >= 2 * EVERY:
                (windows if step % EVERY == EVERY - 1 else plain).append(sum(counter.ops.values()))
        telemetry.flush()
        exported = telemetry.latest["train/m0"]
    finally:
        telemetry.close()
    return int(statistics.median(plain)), int(statistics.median(windows)), exported


def test_a_step_costs_a_few_ops_however_many_metrics_it_updates() -> None:
    """The staged path: the ops of a step and of a window step do not grow with the number K of
    weighted means (not 4 per metric). On the CPU K = 4 (8 entries) is applied in host memory, no
    op; K = 64 and 128 (past `HOST_FOLDS` entries) by the same few ops."""
    small, large, larger = _step_ops(4), _step_ops(64), _step_ops(128)
    assert large[:2] == larger[:2], (large, larger)
    assert small[0] <= large[0] <= 8 and small[1] <= large[1] <= 12, (small, large)
    assert small[2] == large[2] == larger[2] == 1.0


def test_every_leaf_of_a_tree_is_staged_into_one_stage() -> None:
    metrics = {"a": tt.WeightedMeanMetric(), "b": {"c": tt.SumMetric(), "d": tt.MaxMetric()}}
    collector = AsyncMetricCollector(metrics).bind()
    try:
        stages = {id(acc.stage) for leaf in pytree.tree_leaves(metrics) for acc in leaf.accumulators.values()}
        assert len(stages) == 1
    finally:
        collector.unbind()


def test_a_sum_and_its_count_are_staged_as_one_update_or_each_as_it_allows() -> None:
    """`add_with_count`: both staged in one call when every operand can be; when one cannot (a
    count given as a bool), the call stages nothing of its own and each state takes its update as
    `update()` would (the sum staged, the count at once): the same states either way."""
    metric = staged(tt.WeightedMeanMetric())
    reference = tt.WeightedMeanMetric()
    weighted_sum, total_weight = metric.weighted_sum, metric.total_weight
    weighted_sum.add_with_count(torch.tensor(2.0), total_weight, 3, weight=3)
    assert _pending(metric) == 2
    refused = True  # a bool is never staged: added at once, as 1
    weighted_sum.add_with_count(torch.tensor(1.5), total_weight, refused)
    assert _pending(metric) == 3  # the sum staged alone; the count applied at once
    reference.weighted_sum.add_product(torch.tensor(2.0), 3)
    reference.total_weight.update(3)
    reference.weighted_sum.update(torch.tensor(1.5))
    reference.total_weight.update(refused)
    for attr, accumulator in reference.accumulators.items():
        assert metric.accumulators[attr].local.item() == accumulator.local.item(), attr
    with pytest.raises(TypeError, match="add_with_count needs SUM accumulators, got MAX and SUM"):
        tt.MaxMetric().extremum.add_with_count(torch.tensor(1.0), total_weight, 1)


def test_an_update_of_a_bound_metric_checks_for_compilation_once() -> None:
    """The compile check (`torch.compiler.is_compiling`, a Python call into torch) runs once per staged
    update of a weighted mean, for its two states and its three operands together."""
    import sys

    metric = staged(tt.WeightedMeanMetric())
    loss = torch.tensor(2.5)
    metric.update(loss, 512)
    calls: list[str] = []

    def profile(frame, event: str, arg) -> None:
        if event == "call" and frame.f_code is torch.compiler.is_compiling.__code__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        metric.update(loss, 512)
    finally:
        sys.setprofile(None)
    assert len(calls) == 1 and _pending(metric) == 4
    assert metric.compute().item() == 2.5


def _sentinel_step_ops(nonfinite: list[str] | None, losses: list[float]) -> tuple[list[int], Any]:
    """ATen ops of each step that ends no window (two weighted-mean losses fed `losses` in turn, the
    sentinel watching `nonfinite`: None for its default, every loss), and the window's counts."""
    metrics = {"a/loss": tt.WeightedMeanMetric(), "b/loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, every=len(losses), nonfinite=nonfinite)
    plain = []
    try:
        for step, loss in enumerate(losses):
            with OpCounter() as counter:
                metrics["a/loss"].update(torch.tensor(loss), 512)
                metrics["b/loss"].update(torch.tensor(1.0, dtype=torch.bfloat16), 512)
                telemetry.step(step)
            if step < len(losses) - 1:
                plain.append(sum(counter.ops.values()))
        telemetry.flush()
        return plain, telemetry.latest.get("train/nonfinite/count")
    finally:
        telemetry.close()


def test_on_the_cpu_a_staged_non_finite_count_is_read_in_host_memory_and_adds_no_op(applied: str) -> None:
    """The sentinel counts NaN and +-Inf exactly (1 each, 0 for a finite value of any staged dtype);
    on the CPU a count's staged value is read where it lies, in host memory, so a step with the
    sentinel on issues the ops of one without it (no `isnan` / `where` over the staged rows), whether
    the flush applies it in host memory or by ops."""
    losses = [1.0, math.nan, math.inf, -math.inf, 2.0, 3.0]
    counted, counts = _sentinel_step_ops(None, losses)
    uncounted, _ = _sentinel_step_ops([], losses)
    assert counts == {"a/loss": 3.0, "b/loss": 0.0}
    assert counted == uncounted, (counted, uncounted)
