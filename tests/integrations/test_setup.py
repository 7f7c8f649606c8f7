"""`build_telemetry`: the set-up the Lightning, Hugging Face and accelerate adapters share."""

from __future__ import annotations

import torch

from torchtelemetry import SumMetric, TelemetryConfig
from torchtelemetry.integrations._setup import build_telemetry


def test_the_run_config_goes_on_top_of_the_framework_s_and_fields_override_the_config() -> None:
    metrics = {"train": {"examples": SumMetric(kind="counter")}}
    config = TelemetryConfig(run_id="setup", every=5, run_config={"lr": 0.1, "note": "mine"}, signals=False)
    telemetry = build_telemetry(
        "Adapter",
        metrics,
        (),
        config,
        device=torch.device("cpu"),
        framework_config={"lr": 0.5, "batch_size": 8},
        every=2,
    )
    try:
        assert telemetry.run.run_id == "setup"
        assert dict(telemetry.run.config) == {"lr": 0.1, "note": "mine", "batch_size": 8}
        assert telemetry.config.every == 2
        assert metrics["train"]["examples"].device == torch.device("cpu")
    finally:
        telemetry.close()
