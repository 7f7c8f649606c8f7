"""`TelemetryConfig.trace_ranks`: checked at construction, on by default only where spans can go."""

from __future__ import annotations

import os
import threading

import pytest

import torchtelemetry as tt
from tests.receivers import OtlpHttpReceiver
from torchtelemetry.run import TRACES_THREAD


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_trace_ranks_must_be_none_or_a_count(value: object) -> None:
    with pytest.raises(ValueError, match=r"TelemetryConfig\.trace_ranks must be None or an integer >= 0"):
        tt.TelemetryConfig(trace_ranks=value)  # type: ignore[arg-type]


def test_traces_asked_for_without_an_otlp_exporter_or_the_signals_are_refused() -> None:
    metrics = {"loss": tt.WeightedMeanMetric()}
    with pytest.raises(ValueError, match=r"trace_ranks=3: .*exporters has no OTelExporter.*trace_ranks=0"):
        tt.Telemetry(metrics, [tt.ConsoleExporter()], trace_ranks=3, nvml=False)
    with pytest.raises(ValueError, match=r"trace_ranks=1: .*signals=False"):
        tt.Telemetry(metrics, [tt.OTelExporter()], trace_ranks=1, signals=False)


def test_by_default_traces_are_on_with_an_otlp_exporter_and_off_without() -> None:
    metrics = {"loss": tt.WeightedMeanMetric()}
    with OtlpHttpReceiver() as receiver:
        for exporters, sent in (
            ([tt.ConsoleExporter()], False),
            ([tt.OTelExporter(endpoint=receiver.metrics_endpoint)], True),
        ):
            telemetry = tt.Telemetry(metrics, exporters, every=1, nvml=False, hang_after_s=None)
            for step in range(2):
                with telemetry.phase("forward"):
                    pass
                telemetry.step(step)
            telemetry.flush()
            threads = [thread.name for thread in threading.enumerate()]
            telemetry.close()
            assert (TRACES_THREAD in threads) == sent
            exemplar = telemetry.latest["train/step_time/histogram"].exemplar
            assert (exemplar is not None) == sent
        spans = receiver.spans()
    assert {span.attributes["torchtelemetry.step"] for span in spans if span.name == "train.step"} == {0, 1}
    assert exemplar.trace_id in {span.trace_id for span in spans}
