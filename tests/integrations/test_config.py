"""Every adapter takes one `TelemetryConfig` (plus field overrides) and builds its `Telemetry` from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtelemetry import JsonlExporter, SumMetric, TelemetryConfig

pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.test_lightning import _single_process_fit
from torchtelemetry.integrations import (
    LightningTelemetryCallback,
    TelemetryTracker,
    TrainerTelemetryCallback,
)

ADAPTERS = [LightningTelemetryCallback, TrainerTelemetryCallback, TelemetryTracker]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_adapters_take_a_config_and_field_overrides(adapter) -> None:
    base = TelemetryConfig(run_id="shared", queue_size=3, run_config={"lr": 0.1})
    built = adapter({}, (), base, timeout_s=60.0)
    assert built.config == base.replace(timeout_s=60.0)
    assert adapter({}, ()).config == TelemetryConfig()  # the same defaults as Telemetry's


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_bad_fields_fail_at_construction_naming_the_field(adapter) -> None:
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['evry'\]; valid fields are"):
        adapter({}, (), evry=5)
    with pytest.raises(ValueError, match=r"TelemetryConfig\.queue_size must be at least 1"):
        adapter({}, (), queue_size=0)


def test_the_hugging_face_trainer_decides_when_to_collect() -> None:
    with pytest.raises(TypeError, match="logging_steps"):
        TrainerTelemetryCallback({}, (), every=5)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_lightning_collects_every_log_every_n_steps_unless_every_is_given(tmp_path: Path) -> None:
    # _single_process_fit's Trainer keeps Lightning's default log_every_n_steps=50 > max_steps: only
    # teardown's partial window; every=1 collects after every optimizer step.
    default = LightningTelemetryCallback({"n": SumMetric()}, [JsonlExporter(tmp_path / "default.jsonl")])
    _single_process_fit(default, 2, tmp_path / "a")
    given = LightningTelemetryCallback({"n": SumMetric()}, [JsonlExporter(tmp_path / "every.jsonl")], every=1)
    _single_process_fit(given, 2, tmp_path / "b")
    assert _steps(tmp_path / "default.jsonl") == [2]
    assert _steps(tmp_path / "every.jsonl") == [1, 2]
