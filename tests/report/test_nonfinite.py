"""The health sentinel: exact non-finite counts in the update path, never filtered, first rank; spikes."""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.metric.examples import PATHS, on_path
from tests.ops import OpCounter, TorchDispatchMode
from tests.report.windows import collect_window, context
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report.signals import MIN_HISTORY, NonFiniteSentinel, SignalSet, Spikes, watched_metrics


def _sentinel(
    metrics: dict, paths=None, world_size: int = 1, rank: int = 0
) -> tuple[SignalSet, NonFiniteSentinel]:
    leaves = metric_leaves(metrics)
    sentinel = NonFiniteSentinel(context(world_size, rank), watched_metrics(leaves, paths))
    return SignalSet([sentinel]), sentinel


@pytest.mark.parametrize("nan_policy", ["propagate", "ignore"])
def test_counts_are_exact_and_the_metric_still_sees_what_its_policy_says(nan_policy: str) -> None:
    loss = tt.WeightedMeanMetric(nan_policy=nan_policy)
    norms = tt.MaxMetric(nan_policy=nan_policy)
    signals, _ = _sentinel({"train": {"loss": loss, "grad_norm": norms}}, ["train/loss", "train/grad_norm"])
    loss.update(torch.tensor(1.0), 2)
    loss.update(torch.tensor(float("nan")), 1)
    loss.update(torch.tensor([2.0, float("inf"), -float("inf")]), torch.tensor([1.0, 1.0, 1.0]))
    loss.update(float("nan"))  # a Python number, counted on the host
    norms.update(torch.tensor([[1.0, float("nan")], [3.0, 4.0]]))
    norms.update(torch.tensor([1, 2]))  # integers are never non-finite
    value = loss.compute().item()
    window = collect_window(signals, step=4)
    assert window["train/nonfinite/count"] == {"train/loss": 4.0, "train/grad_norm": 1.0}
    assert window["train/nonfinite/first_rank"] == {"train/loss": 0.0, "train/grad_norm": 0.0}
    assert window["train/nonfinite/first_step"] == {"train/loss": 4.0, "train/grad_norm": 4.0}
    # The sentinel counts and replaces nothing: the metric's own policy decides its value.
    assert math.isnan(value) if nan_policy == "propagate" else value == pytest.approx(4.0 / 3.0)


def test_a_clean_window_exports_zero_counts_and_no_first_rank() -> None:
    loss = tt.WeightedMeanMetric()
    signals, _ = _sentinel({"train": {"loss": loss}})
    loss.update(torch.tensor(1.0))
    window = collect_window(signals)
    assert window["train/nonfinite/count"] == {"train/loss": 0.0}
    assert "train/nonfinite/first_rank" not in window


def _window_step_ops(losses: list[float], **config) -> tuple[list[int], dict]:
    """ATen ops of each window step (a window every 2 steps) of a loop updating `train/loss` with
    `losses`, and the last report."""
    loss = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry({"train": {"loss": loss}}, every=2, window_lines=False, **config)
    try:
        ops = []
        for step, value in enumerate(losses):
            loss.update(torch.tensor(value), 1)
            with OpCounter() as counter:
                telemetry.step(step)
            if step % 2 == 1:
                ops.append(sum(counter.ops.values()))
        telemetry.flush()
        return ops, dict(telemetry.latest)
    finally:
        telemetry.close()


def test_on_the_cpu_the_sentinel_marks_its_rank_with_no_op_of_its_own() -> None:
    """On the CPU the window's flush reads the counts in host memory and stages this rank's mark with
    the window's other host values: a window step costs the same ops whether the loss is watched or
    not, and a window that saw a NaN still names this rank, first in it."""
    clean = [1.0] * 8
    watched, _ = _window_step_ops(clean)
    unwatched, _ = _window_step_ops(clean, nonfinite=[])
    assert watched == unwatched, (watched, unwatched)
    _, report = _window_step_ops([1.0, 1.0, 1.0, float("nan"), 1.0, 1.0])
    assert report["train/nonfinite/count"] == {"train/loss": 1.0}
    assert report["train/nonfinite/first_rank"] == {"train/loss": 0.0}
    assert report["train/nonfinite/first_step"] == {"train/loss": 3.0}


def test_losses_are_watched_by_default_and_unknown_paths_are_refused() -> None:
    metrics = {
        "train": {"loss": tt.WeightedMeanMetric(), "acc": tt.AccuracyMetric()},
        "val": {"nll_loss": tt.SumMetric()},
    }
    assert list(watched_metrics(metric_leaves(metrics), None)) == ["train/loss", "val/nll_loss"]
    with pytest.raises(ValueError, match=r"\['train/los'\] are not metric paths"):
        watched_metrics(metric_leaves(metrics), ["train/los"])
    with pytest.raises(TypeError, match="sequence of metric paths"):
        watched_metrics(metric_leaves(metrics), "train/loss")


def test_close_gives_the_metric_its_own_update_back_and_two_sentinels_count_independently() -> None:
    loss = tt.WeightedMeanMetric()
    first, first_sentinel = _sentinel({"loss": loss}, ["loss"])
    second, second_sentinel = _sentinel({"loss": loss}, ["loss"])
    loss.update(torch.tensor(float("nan")))
    first_sentinel.close()
    loss.update(torch.tensor(float("nan")))
    assert collect_window(first)["train/nonfinite/count"] == {"loss": 1.0}
    assert collect_window(second)["train/nonfinite/count"] == {"loss": 2.0}
    second_sentinel.close()
    assert "update" not in loss.__dict__


def _nan_on_rank(rank: int, world_size: int, bad_rank: int) -> list[dict]:
    loss = tt.WeightedMeanMetric()
    signals, sentinel = _sentinel({"train": {"loss": loss}}, None, world_size, rank)
    windows = []
    for window_step in (1, 3, 5):
        loss.update(torch.tensor(1.0))
        if window_step >= 3 and rank >= bad_rank:  # from the second window on, ranks >= bad_rank
            loss.update(torch.tensor([float("nan"), 2.0]))
        windows.append(collect_window(signals, step=window_step))
    state = json.loads(json.dumps(sentinel.state_dict()))
    restored, restored_sentinel = _sentinel(
        {"train": {"loss": tt.WeightedMeanMetric()}}, None, world_size, rank
    )
    restored_sentinel.load_state_dict(state)
    windows.append(collect_window(restored, step=7))
    return windows


@pytest.mark.timeout(120)
def test_the_first_rank_to_see_one_is_a_value_that_lasts_and_counts_add_over_ranks() -> None:
    windows = run_ranks(_nan_on_rank, 3, 1)[0]
    assert [w["train/nonfinite/count"]["train/loss"] for w in windows] == [0.0, 2.0, 2.0, 0.0]
    assert "train/nonfinite/first_rank" not in windows[0]
    for window in windows[1:]:  # the window at step 3 saw it first, on ranks 1 and 2: rank 1
        assert window["train/nonfinite/first_rank"] == {"train/loss": 1.0}
        assert window["train/nonfinite/first_step"] == {"train/loss": 3.0}


def test_spike_scores_follow_the_recent_windows_and_survive_a_checkpoint() -> None:
    spikes = Spikes(context(), ("train/loss",), sigma=6.0, windows=MIN_HISTORY)
    history = [2.0, 2.1, 1.9, 2.0, 2.1, 1.9, 2.0, 2.0]
    for value in history:
        window = {"train/loss": value}
        spikes.derive(window, _timing())
        assert window["train/spike/count"] == {"train/loss": 0.0} and "train/spike/score" not in window
    mean = sum(history) / len(history)
    spread = math.sqrt(sum((v - mean) ** 2 for v in history) / len(history))
    restored = Spikes(context(), ("train/loss",), sigma=6.0, windows=MIN_HISTORY)
    restored.load_state_dict(json.loads(json.dumps(spikes.state_dict())))
    window = {"train/loss": 3.0}
    restored.derive(window, _timing())
    assert window["train/spike/score"] == {"train/loss": pytest.approx((3.0 - mean) / spread)}
    assert window["train/spike/count"] == {"train/loss": 1.0}
    window = {"train/loss": float("nan")}
    restored.derive(window, _timing())
    assert "train/spike/score" not in window and window["train/spike/count"] == {"train/loss": 0.0}
    with pytest.raises(ValueError, match="spike_windows must be at least"):
        Spikes(context(), (), sigma=6.0, windows=2)


def test_a_constant_history_scores_nothing_though_its_float_mean_is_not_its_value() -> None:
    history = [0.1] * 12
    assert math.fsum(history) / len(history) != 0.1  # a float mean would see a spread of rounding
    spikes = Spikes(context(), ("train/loss",), sigma=6.0, windows=len(history))
    for value in [*history, 0.1, 0.2]:
        window = {"train/loss": value}
        spikes.derive(window, _timing())
        assert window["train/spike/count"] == {"train/loss": 0.0} and "train/spike/score" not in window


@pytest.mark.parametrize("scale", [1e-170, 1e-3, 1.0, 1e160])
def test_spike_scores_are_those_of_the_exact_mean_and_deviation(scale: float) -> None:
    """In floats, with the deviations scaled before they are squared: as `statistics` computes them
    exactly, at any scale (the squares of 1e-170 underflow, those of 1e160 overflow)."""
    import statistics

    from torchtelemetry.report.signals._spikes import mean_and_deviation

    generator = np.random.default_rng(0)
    for size in (MIN_HISTORY, 13, 32):
        history = [scale * (2.0 + float(x)) for x in generator.normal(0, 0.05, size)]
        spikes = Spikes(context(), ("train/loss",), sigma=6.0, windows=size)
        spikes.load_state_dict({"history": {"train/loss": history}})
        window = {"train/loss": scale * 2.5}
        spikes.derive(window, _timing())
        exact = (scale * 2.5 - statistics.fmean(history)) / statistics.pstdev(history)
        assert window["train/spike/score"]["train/loss"] == pytest.approx(exact, rel=1e-12)
        assert mean_and_deviation(history) == pytest.approx(
            (statistics.fmean(history), statistics.pstdev(history)), rel=1e-12
        )
        assert window["train/spike/count"] == {"train/loss": float(exact > 6.0)}


def _timing():
    from torchtelemetry.report.signals import WindowTiming

    return WindowTiming(step=0, timestamp=0.0, duration_s=1.0)


NAN, INF = float("nan"), float("inf")
# Every form of input a metric takes, with its count of NaN and +-Inf entries.
INPUTS = {
    "Python float": (lambda: INF, 1),
    "numpy float32 scalar": (lambda: np.float32("nan"), 1),
    "numpy float64 scalar": (lambda: np.float64("-inf"), 1),
    "numpy array": (lambda: np.array([NAN, 1.0, INF]), 2),
    "numpy float16 array": (lambda: np.array([[NAN, 1.0], [INF, 2.0]], dtype=np.float16), 2),
    "list": (lambda: [NAN, 1.0, INF], 2),
    "nested list": (lambda: [[NAN, 1.0], [2.0, -INF]], 2),
    "0-d tensor": (lambda: torch.tensor(NAN), 1),
    "0-d CPU tensor": (lambda: torch.tensor(INF, dtype=torch.float16), 1),
    "float64 tensor": (lambda: torch.tensor([NAN, 1.0, INF], dtype=torch.float64), 2),
    "float16 tensor": (lambda: torch.tensor([NAN, 1.0, INF], dtype=torch.float16), 2),
    "bfloat16 tensor": (lambda: torch.tensor([NAN, 1.0, -INF], dtype=torch.bfloat16), 2),
    "float8_e5m2 tensor": (lambda: torch.tensor([NAN, 1.0, INF]).to(torch.float8_e5m2), 2),
    "float8_e4m3fn tensor": (lambda: torch.tensor([NAN, 1.0]).to(torch.float8_e4m3fn), 1),
    "tensor that requires grad": (lambda: torch.tensor([NAN, 1.0], requires_grad=True), 1),
    "int64 tensor": (lambda: torch.tensor([1, 2]), 0),
    "numpy int array": (lambda: np.array([1, 2]), 0),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("make", "expected"), INPUTS.values(), ids=INPUTS.keys())
def test_the_sentinel_counts_every_form_of_input_a_metric_takes(make, expected: int, path: str) -> None:
    """Staged (a 0-d value's count applied with the step's updates) or not, the same count."""
    metric = on_path(tt.SumMetric(), path)
    signals, sentinel = _sentinel({"train": {"loss": metric}})
    on_path(sentinel.counts, path)
    metric.update(make())
    metric.update(make())
    assert collect_window(signals)["train/nonfinite/count"] == {"train/loss": 2.0 * expected}
    sentinel.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_value_refused_under_nan_policy_error_is_counted_before_the_refusal(path: str) -> None:
    loss = on_path(tt.WeightedMeanMetric(nan_policy="error"), path)
    signals, sentinel = _sentinel({"train": {"loss": loss}})
    on_path(sentinel.counts, path)
    loss.update(torch.tensor(2.0), 3)
    with pytest.raises(ValueError, match="contains NaN or Inf and nan_policy='error'"):
        loss.update(torch.tensor(NAN))  # a 0-d value: its count is staged
    with pytest.raises(ValueError, match="contains NaN or Inf and nan_policy='error'"):
        loss.update(torch.tensor([1.0, NAN, INF]))
    with pytest.raises(ValueError, match="contains NaN or Inf and nan_policy='error'"):
        loss.update(np.float32("nan"))
    assert loss.compute().item() == 2.0  # the metric refused all three, as its policy says
    assert collect_window(signals)["train/nonfinite/count"] == {"train/loss": 4.0}
    sentinel.close()


class PairLoss(tt.Metric):
    """A custom `*loss` metric whose update takes keywords (watched by default)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = tt.MetricAccumulator(0, "sum", dtype=torch.float64)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Add the squared error of `preds` against `target`."""
        self.total.update(((preds - target) ** 2).sum())

    def compute(self) -> torch.Tensor:
        return self.total.value.clone()


def test_watching_keeps_the_metrics_call_signature() -> None:
    metric = PairLoss()
    signature = inspect.signature(metric.update)
    telemetry = tt.Telemetry({"train": {"pair_loss": metric}}, every=100, run_id="signature")
    try:
        assert inspect.signature(metric.update) == signature
        assert metric.update.__doc__ == PairLoss.update.__doc__
        metric.update(preds=torch.tensor([NAN, 1.0]), target=torch.zeros(2))  # by keyword
        metric.update(torch.tensor([INF]), target=torch.zeros(1))
        metric.update(target=torch.zeros(1), preds=torch.tensor([3.0]))
        with pytest.raises(TypeError, match="unexpected keyword argument 'value'"):
            metric.update(value=torch.tensor([1.0]), target=torch.zeros(1))
        telemetry.step(0)
        telemetry.flush()
        assert telemetry.latest["train/nonfinite/count"] == {"train/pair_loss": 2.0}
    finally:
        telemetry.close()


class _Allocations(TorchDispatchMode):
    """The new tensors of `numel` entries that ops return (not a view or an in-place result: those
    share an input's storage)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.made: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == self.numel:
            storage = out.untyped_storage().data_ptr()
            inputs = [arg for arg in args if isinstance(arg, torch.Tensor)]
            if all(arg.untyped_storage().data_ptr() != storage for arg in inputs):
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counting_a_tensor_allocates_one_temporary_the_size_of_the_input(dtype: torch.dtype) -> None:
    _, sentinel = _sentinel({"train": {"loss": tt.MaxMetric()}})
    value = torch.zeros(1 << 16, dtype=dtype)
    with _Allocations(value.numel()) as allocations:
        sentinel.counts.count(0, value)
    assert len(allocations.made) == 1, allocations.made
    sentinel.close()
