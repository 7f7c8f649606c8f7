"""The demo's command line is generated from `DemoConfig`: one flag per field, defaults written once."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from torchtelemetry.demo import DemoConfig, build_parser, parse_args
from torchtelemetry.demo._exporters import build_exporters


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert parse_args([], env={}) == DemoConfig()


def test_every_field_has_a_flag_with_its_docstring() -> None:
    actions = {action.dest: action for action in build_parser(env={})._actions}
    for field in dataclasses.fields(DemoConfig):
        assert field.name in actions, field.name
        assert actions[field.name].default == field.default, field.name
        assert actions[field.name].help, f"{field.name} has no help (no docstring?)"
    assert "Sequences per rank per step" in actions["batch_size"].help


def test_flags_set_fields_and_optional_fields_take_none() -> None:
    flags = ["--batch-size", "8", "--lr", "0.01", "--prometheus-port", "none", "--no-console"]
    config = parse_args([*flags, "--step-delay", "0.5"], env={})  # a unique prefix, as argparse allows
    assert (config.batch_size, config.lr, config.prometheus_port) == (8, 0.01, None)
    assert (config.console, config.step_delay_s) == (False, 0.5)


def test_argument_beats_environment_beats_default() -> None:
    env = {"TORCHTELEMETRY_PROMETHEUS_PORT": "0", "TORCHTELEMETRY_WANDB": "offline"}
    assert (parse_args([], env=env).prometheus_port, parse_args([], env=env).wandb) == (0, "offline")
    assert parse_args(["--prometheus-port", "9999"], env=env).prometheus_port == 9999
    # An OTLP endpoint in the OTEL_* variables turns the OTLP exporter on, configured by them.
    assert parse_args([], env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}).otlp == ""
    assert parse_args([], env={}).otlp is None


def test_invalid_values_exit_with_the_field_s_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"], env={})
    assert "demo.device must be 'auto', 'cpu' or 'cuda', got 'tpu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"], env={})
    assert "demo.steps must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint-every", "0"], env={})
    assert "demo.checkpoint_every must be at least 1" in capsys.readouterr().err
    assert parse_args(["--checkpoint-every", "none"], env={}).checkpoint_every is None


EXPORTER_FLAGS = {
    # flag: (the package it needs, the exporter it turns on, where "" puts it when the demo chooses)
    "pushgateway": ("prometheus_client", "PushgatewayExporter", "http://127.0.0.1:9091"),
    "otlp": ("opentelemetry.sdk", "OTelExporter", None),
    "wandb": ("wandb", "WandbExporter", None),
    "tensorboard": ("tensorboard", "TensorBoardExporter", "runs/the-run/tensorboard"),
    "mlflow": ("mlflow", "MLflowExporter", None),
    "jsonl": ("json", "JsonlExporter", "runs/the-run/metrics.jsonl"),
}


def _built(argv: list[str]) -> dict[str, Any]:
    """The exporters the demo builds for `argv` (console and Prometheus off), by class name; closed."""
    config = parse_args([*argv, "--no-console", "--prometheus-port", "none"], env={})
    exporters = build_exporters(config, "the-run")
    for exporter in exporters:
        exporter.close()
    return {type(exporter).__name__: exporter for exporter in exporters}


@pytest.mark.parametrize("flag", sorted(EXPORTER_FLAGS))
def test_an_empty_exporter_flag_turns_it_on_at_its_default_and_none_turns_it_off(flag: str) -> None:
    package, name, default = EXPORTER_FLAGS[flag]
    pytest.importorskip(package)
    option = "--" + flag
    assert getattr(parse_args([option, ""], env={}), flag) == ""
    on = _built([option, ""])
    assert name in on, f'{option} "" must turn {name} on'
    if default is not None:
        assert on[name].destination() == default
    assert name not in _built([option, "none"]), f"{option} none must leave {name} off"
    assert '"" turns it on at its default destination' in build_parser(env={}).epilog


def test_the_jsonl_file_is_written_by_default() -> None:
    assert parse_args([], env={}).jsonl == ""
    assert _built([])["JsonlExporter"].destination() == "runs/the-run/metrics.jsonl"
