"""`Telemetry.watch_layers` in one process: when the norms are measured and what is exported (bounded
above `max_layer_series`), by name across a checkpoint, bad input refused, hooks removed at close,
training bit-identical, and no host sync on the watched step."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

import torchtelemetry as tt
from tests.hostsync import CPU_ONLY_READS, NoHostSync
from torchtelemetry.report.signals import LayerStatistics, LayerWatch, SignalContext

NAN = float("nan")
GRAD, PARAM = "train/layer/grad_norm", "train/layer/param_norm"


def _model(width: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(width)]
    for scale, layer in enumerate(layers, start=1):  # norms that differ by layer
        layer.weight.data.mul_(scale)
    return nn.Sequential(*layers)


def _telemetry(**fields) -> tt.Telemetry:
    return tt.Telemetry(
        {"loss": tt.WeightedMeanMetric()}, hang_after_s=None, capture_on=(), **{"every": 2, **fields}
    )


def _norms(model: nn.Module, grads: bool) -> dict[str, float]:
    """Each module's norm over its own parameters' gradients (those that have one) or values."""
    norms = {}
    for name, module in model.named_modules():
        tensors = [p.grad if grads else p for p in module.parameters(recurse=False)]
        tensors = [t.detach().double() for t in tensors if t is not None]
        if name and tensors:
            norms[name] = math.sqrt(sum(float(t.pow(2).sum()) for t in tensors))
    return norms


def _train(telemetry, model, steps, *, first=0, window=2, optimizer=True, before_step=None):
    """Train steps `first`... (`steps` of them); returns, per window of `window` steps, the layer
    values exported, and the norms computed by hand before each optimizer step. Without `optimizer`,
    gradients are zeroed after `telemetry.step()`."""
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    windows, by_hand = [], []
    for step in range(first, first + steps):
        model(torch.randn(2, 4)).pow(2).sum().backward()
        by_hand.append((_norms(model, grads=True), _norms(model, grads=False)))
        if before_step is not None:
            before_step(step, model)
        if optimizer:
            sgd.step()
            sgd.zero_grad()
        telemetry.step(step)
        sgd.zero_grad()
        if (step + 1) % window == 0:
            telemetry.flush()
            windows.append({k: v for k, v in telemetry.latest.items() if k.startswith("train/layer/")})
    return windows, by_hand


def test_norms_are_measured_at_each_windows_last_step_before_the_optimizer_changes_them() -> None:
    model = _model()
    telemetry = _telemetry()
    telemetry.watch_layers(model)
    windows, by_hand = _train(telemetry, model, 4)
    telemetry.close()
    for window, (grads, params) in zip(windows, (by_hand[1], by_hand[3]), strict=True):
        assert window[GRAD] == pytest.approx(grads, rel=1e-6)
        assert window[PARAM] == pytest.approx(params, rel=1e-6)


def test_every_n_steps_is_reported_in_the_window_that_holds_it_and_without_an_optimizer_at_step() -> None:
    model = _model()
    telemetry = _telemetry()
    telemetry.watch_layers(model, stats=("grad_norm",), every=3)
    windows, by_hand = _train(telemetry, model, 6, optimizer=False)
    telemetry.close()
    # Steps 2 and 5 (the 3rd and 6th) are measured: in the windows ending at steps 3 and 5.
    assert [GRAD in window for window in windows] == [False, True, True]
    assert windows[1][GRAD] == pytest.approx(by_hand[2][0], rel=1e-6)
    assert windows[2][GRAD] == pytest.approx(by_hand[5][0], rel=1e-6)
    assert all(PARAM not in window for window in windows)


def test_above_max_layer_series_the_largest_layers_and_min_median_max_are_exported() -> None:
    model = _model(width=5)
    telemetry = _telemetry(max_layer_series=2)
    telemetry.watch_layers(model)

    def poison(step, model):  # layer 0, the smallest, gets a NaN gradient: it is shown first
        if step == 3:
            model[0].weight.grad[0, 0] = NAN

    windows, by_hand = _train(telemetry, model, 4, before_step=poison)
    telemetry.close()
    grads, params = by_hand[1]
    largest = sorted(grads, key=grads.get)[-2:]
    assert windows[0][GRAD] == pytest.approx({name: grads[name] for name in largest}, rel=1e-6)
    assert windows[0][PARAM] == pytest.approx({name: params[name] for name in largest}, rel=1e-6)
    ordered = sorted(grads.values())
    assert windows[0][f"{GRAD}/min"] == pytest.approx(ordered[0])
    assert windows[0][f"{GRAD}/median"] == pytest.approx(ordered[2])
    assert windows[0][f"{GRAD}/max"] == pytest.approx(ordered[-1])
    grads = by_hand[3][0]
    largest = max(set(grads) - {"0"}, key=grads.get)
    exported = windows[1][GRAD]
    assert list(exported) == ["0", largest] and math.isnan(exported["0"])  # a NaN first, then the largest
    assert exported[largest] == pytest.approx(grads[largest], rel=1e-6)
    assert math.isnan(windows[1][f"{GRAD}/max"])  # a NaN anywhere shows in the max
    assert windows[1][f"{GRAD}/min"] == pytest.approx(min(v for name, v in grads.items() if name != "0"))


def test_layers_given_by_path_hold_every_parameter_under_them_and_frozen_ones_have_no_gradient_norm() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    model[1].requires_grad_(False)
    telemetry = _telemetry()
    telemetry.watch_layers(model, layers=["0", "1"])
    by_path = []

    def measure(step, model):
        by_path.append(
            {
                "grad": math.sqrt(
                    sum(float(p.grad.detach().double().pow(2).sum()) for p in model[0].parameters())
                ),
                "0": math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model[0].parameters())),
                "1": math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in model[1].parameters())),
            }
        )

    windows, _ = _train(telemetry, model, 2, before_step=measure)
    telemetry.close()
    assert windows[0][GRAD] == pytest.approx({"0": by_path[1]["grad"]}, rel=1e-6)
    assert windows[0][PARAM] == pytest.approx({"0": by_path[1]["0"], "1": by_path[1]["1"]}, rel=1e-6)


def test_the_partial_window_and_the_first_nan_survive_a_checkpoint_by_layer_name() -> None:
    model = _model()
    telemetry = _telemetry(every=3)
    telemetry.watch_layers(model, every=2)

    handle = model[1].weight.register_hook(lambda grad: grad * NAN)  # in step 0's backward
    _train(telemetry, model, 1, window=3, optimizer=False)
    handle.remove()
    _, later = _train(telemetry, model, 1, first=1, window=3, optimizer=False)
    state = telemetry.state_dict()  # mid-window: step 1 measured, not yet reported
    telemetry.close()
    restored_model = _model(width=4)  # a layer more: rows are restored by name
    restored = _telemetry(every=3)
    restored.watch_layers(restored_model, every=2)
    restored.load_state_dict(state)
    windows, _ = _train(restored, restored_model, 1, first=2, window=3, optimizer=False)
    restored.close()
    assert windows[0]["train/layer/first_nonfinite/backward"] == {"1": 0.0}
    assert windows[0]["train/layer/first_nonfinite_rank/backward"] == {"1": 0.0}
    assert windows[0][GRAD] == pytest.approx(later[0][0], rel=1e-6)
    assert windows[0][PARAM] == pytest.approx(later[0][1], rel=1e-6)


def test_bad_arguments_are_refused_naming_what_is_wrong() -> None:
    model = _model()
    telemetry = _telemetry()
    with pytest.raises(ValueError, match="stats must be a sequence of"):
        telemetry.watch_layers(model, stats="grad_norm")
    with pytest.raises(ValueError, match="stats must be a sequence of"):
        telemetry.watch_layers(model, stats=("grad_norms",))
    with pytest.raises(ValueError, match="every must be a positive number of steps"):
        telemetry.watch_layers(model, every=0)
    with pytest.raises(ValueError, match=r"\['2\.weight'\] are not module paths"):
        telemetry.watch_layers(model, layers=["2.weight"])
    with pytest.raises(ValueError, match="is on meta, but this Telemetry's window is on cpu"):
        telemetry.watch_layers(_model().to("meta"))
    telemetry.watch_layers(model)
    with pytest.raises(RuntimeError, match="watched already"):
        telemetry.watch_layers(model)
    telemetry.close()
    with pytest.raises(ValueError, match="max_layer_series must be at least 0"):
        tt.TelemetryConfig(max_layer_series=-1)


def _hook_counts(model: nn.Module) -> tuple[int, int, int]:
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    forward = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    grads = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return forward, grads, len(_global_optimizer_pre_hooks)


def test_training_is_bit_identical_and_close_removes_every_hook() -> None:
    plain = _model()
    watched = copy.deepcopy(plain)
    before = _hook_counts(watched)
    telemetry = _telemetry()
    telemetry.watch_layers(watched)
    assert _hook_counts(watched) != before
    for model in (plain, watched):
        torch.manual_seed(5)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for step in range(5):
            model(torch.randn(3, 4)).pow(2).sum().backward()
            sgd.step()
            sgd.zero_grad()
            if model is watched:
                telemetry.step(step)
    telemetry.close()
    assert _hook_counts(watched) == before
    for a, b in zip(plain.parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_watched_training_step_never_reads_a_value_on_the_host() -> None:
    model = _model()
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry({"loss": loss_metric}, every=2, hang_after_s=None, capture_on=())
    telemetry.watch_layers(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(2, 4) for _ in range(8)]
    for step, batch in enumerate(batches):
        if step == 2:
            batch[0, 0] = NAN  # the checks find it without reading it
        checked = NoHostSync(exempt=CPU_ONLY_READS)
        with checked if step >= 2 else contextlib.nullcontext():
            loss = model(batch).pow(2).sum()
            loss.backward()
            sgd.step()  # the measured step (every second one): measured here
            sgd.zero_grad()
            loss_metric.update(loss.detach())
            telemetry.step(step)
    telemetry.close()
    assert telemetry.latest["train/layer/first_nonfinite/forward"] == {"0": 2.0}


def test_the_checks_and_the_measurement_on_a_device_never_sync_it() -> None:
    meta = torch.device("meta")
    signal = LayerStatistics(SignalContext(world_size=4, rank=1, device=meta), every=1)
    model = _model().to(meta)
    signal.watch_layers(model, LayerWatch())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with NoHostSync():
        model(torch.randn(2, 4, device=meta)).sum().backward()
        sgd.step()
        signal.on_step(0, 0.1)
    signal.close()


def test_without_the_nonfinite_checks_no_hook_is_in_the_model_and_the_norms_are_still_measured() -> None:
    model = _model()
    before = _hook_counts(model)
    telemetry = _telemetry()
    telemetry.watch_layers(model, nonfinite=False)
    assert _hook_counts(model)[:2] == before[:2]  # only the optimizer hook that measures the norms
    _train(telemetry, model, 1)
    handle = model[1].weight.register_hook(lambda grad: grad * NAN)  # in step 1's backward
    windows, by_hand = _train(telemetry, model, 1, first=1)
    handle.remove()
    telemetry.close()
    assert not any("first_nonfinite" in name for name in windows[0])
    assert math.isnan(windows[0][GRAD]["1"])
    assert windows[0][PARAM] == pytest.approx(by_hand[0][1], rel=1e-6)
