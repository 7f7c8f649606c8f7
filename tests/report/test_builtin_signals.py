"""The built-in signals as objects: each says what it exports, and exports nothing else."""

from __future__ import annotations

import logging

import pytest
import torch

import torchtelemetry as tt
from tests.report.windows import collect_window, context
from tests.step_inputs import step_inputs
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import ModelFlops, RankSeriesLimit
from torchtelemetry.report.signals import (
    CAPTURE_DESCRIPTORS,
    Captures,
    LayerWatch,
    Phases,
    Signal,
    SignalSet,
    builtin_descriptors,
    builtin_signals,
    event_only_descriptors,
)


def _signals(max_rank_series: int = 64, **overrides) -> tuple[SignalSet, dict]:
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    options = {
        "leaves": metric_leaves(metrics),
        "flops": ModelFlops(per_unit=6e6, per_sample=False, peak=1e12),
        "phases": ("forward", "backward"),
        "straggler_top_k": 2,
        "nonfinite": None,
        "spike_sigma": 6.0,
        "spike_windows": 8,
        "nvml": False,
    }
    return SignalSet(
        builtin_signals(context(max_rank_series=max_rank_series), **options | overrides)
    ), metrics


def _feed(
    signals: SignalSet, metrics: dict, steps: int, loss: tuple[float, ...] = (2.0, float("nan"))
) -> None:
    for step in range(steps):
        with signals.data_wait_timer():
            pass
        with signals.phase("forward"):
            metrics["train"]["loss"].update(torch.tensor(loss))
        with signals.phase("backward"):
            pass
        signals.record_step(
            step, None if step == 0 else 0.01, step_inputs(tokens=torch.tensor(128), samples=4)
        )


@pytest.mark.parametrize("max_rank_series", [64, 0])
def test_every_name_a_window_exports_is_described_and_no_raw_state_leaks(max_rank_series: int) -> None:
    signals, metrics = _signals(max_rank_series)
    _feed(signals, metrics, 3)
    ranks = RankSeriesLimit(1, max_rank_series)  # what the publisher does after the signals
    names = {descriptor.name for descriptor in ranks.describe(signals.descriptors())}
    window = collect_window(signals, step=2, steps=3, duration_s=0.1)
    ranks.derive(window)
    signals.close()
    assert set(window) <= names, sorted(set(window) - names)
    for name in ("train/tokens", "train/tokens_per_second", "train/mfu", "train/learning_rate"):
        assert name in window
    assert window["train/nonfinite/count"] == {"train/loss": 3.0}
    assert window["train/tokens"] == 3 * 128 and window["train/samples"] == 12


def test_event_names_are_described_and_a_healthy_window_has_none() -> None:
    """What each signal declares exported only once something happened (`Signal.event_names`: the
    dashboards' checks leave their panels out) is a name it describes, and absent from a window of
    healthy steps, as are a hang report's."""
    signals, metrics = _signals()
    _feed(signals, metrics, 3, loss=(2.0, 3.0))
    window = collect_window(signals, step=2, steps=3, duration_s=0.1)
    signals.close()
    for signal in (*signals.signals, Captures):
        described = {d.name for d in (CAPTURE_DESCRIPTORS if signal is Captures else signal.descriptors())}
        assert signal.event_names <= described, signal.name
    events = {descriptor.name for descriptor in event_only_descriptors()}
    assert {"train/nonfinite/first_step", "train/straggler/top_rank", "train/hang/rank"} <= events
    assert "train/nonfinite/count" in window and not set(window) & events, sorted(set(window) & events)


def test_unfed_signals_export_nothing() -> None:
    signals, _ = _signals()
    signals.record_step(0, None, {})
    window = collect_window(signals)
    signals.close()
    for name in ("train/tokens", "train/samples", "train/learning_rate", "train/data_wait", "train/mfu"):
        assert name not in window
    assert not any(name.startswith(("train/phase/", "train/phases/")) for name in window)


def test_every_signal_is_one_object_with_a_unique_name_and_keywords() -> None:
    signals, _ = _signals()
    assert all(isinstance(signal, Signal) for signal in signals.signals)
    assert signals.keywords >= {"tokens", "samples", "learning_rate", "data_time"}  # and any new one
    with pytest.raises(ValueError, match=r"used twice"):
        SignalSet([*signals.signals, signals.signals[0]])
    with pytest.raises(TypeError, match=r"no signal takes \['token'\]"):
        signals.record_step(0, None, {"token": 3})
    signals.close()


def test_every_step_keyword_has_a_sample_input_its_signal_accepts() -> None:
    """What the tests' training loops feed `step()` (tests/step_inputs.py): one sample per keyword,
    declared by the signal that takes it."""
    signals, _ = _signals()
    try:
        for signal in signals.signals:
            samples = signal.sample_inputs()
            assert set(samples) == set(signal.keywords), signal.name
            for keyword, value in samples.items():
                signal.check(keyword, value)
        assert set(step_inputs()) == signals.keywords
    finally:
        signals.close()


def test_step_routes_each_keyword_to_the_signal_that_declares_it() -> None:
    """`Telemetry.step(**inputs)` knows no keyword itself: it takes those its signals declare, and an
    unknown one is refused naming them, with nothing of the step recorded."""
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, every=2, nvml=False)
    try:
        declared = {keyword for signal in telemetry._signals.signals for keyword in signal.keywords}
        assert telemetry.step_keywords == declared >= {"tokens", "samples", "learning_rate", "data_time"}
        with pytest.raises(TypeError, match=r"no signal takes \['token'\] \(signals take \['data_time'"):
            telemetry.step(0, tokens=5, token=3)
        telemetry.step(0, tokens=7, learning_rate=0.5)
        telemetry.step(1, tokens=3)
        telemetry.flush()
        assert telemetry.latest["train/tokens"] == 10.0  # the refused step recorded none of its tokens
    finally:
        telemetry.close()


def test_step_keywords_with_the_signals_off_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    telemetry = tt.Telemetry({"loss": tt.SumMetric()}, every=2, signals=False)
    try:
        assert telemetry.step_keywords == frozenset()
        with caplog.at_level(logging.WARNING, logger="torchtelemetry"):
            for step in range(3):
                telemetry.step(step, tokens=5, learning_rate=None)
        warned = [r.getMessage() for r in caplog.records if "signals are off" in r.getMessage()]
        assert len(warned) == 1 and "['tokens']" in warned[0]
    finally:
        telemetry.close()


def test_builtin_descriptors_name_every_shape_once() -> None:
    names = [descriptor.name for descriptor in builtin_descriptors()]
    assert len(names) == len(set(names))
    for name in ("train/memory/max_active", "hw/gpu/power/max", "train/memory/headroom/min", "train/mfu"):
        assert name in names


def test_a_failed_set_up_leaves_the_users_metrics_as_they_were() -> None:
    loss = tt.WeightedMeanMetric()
    with pytest.raises(ValueError, match=r"\['train/tokens'\] are defined twice"):
        tt.Telemetry({"train": {"loss": loss, "tokens": tt.SumMetric()}})
    assert "update" not in loss.__dict__, "the sentinel's counting stays only while a Telemetry runs"


def test_the_model_watches_reach_their_one_signal_and_say_when_it_is_off() -> None:
    """`watch_gradient_sync` and `watch_layers` are no hooks every signal has: the set finds the one
    signal of each (and tells the phases which phase holds the collective); without it, it says so."""
    signals, _ = _signals()
    (phases,) = [signal for signal in signals.signals if isinstance(signal, Phases)]
    model = torch.nn.Linear(2, 2)
    signals.watch_gradient_sync(model, "forward")
    assert phases.stragglers.sync_phase == "forward"
    signals.watch_layers(model, LayerWatch())
    with pytest.raises(RuntimeError, match=r"layers are watched already"):
        signals.watch_layers(model, LayerWatch())
    signals.close()
    alone = SignalSet([Phases(context(), ("forward", "backward"))])
    with pytest.raises(ValueError, match=r"the sync wait signal \('sync_wait'\) is not in this SignalSet"):
        alone.watch_gradient_sync(model, "backward")
    with pytest.raises(
        ValueError, match=r"the layer statistics signal \('layers'\) is not in this SignalSet"
    ):
        alone.watch_layers(model, LayerWatch())
    alone.close()
