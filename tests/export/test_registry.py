"""Exporters by name through the `torchtelemetry.exporters` entry points; the public import surface."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchtelemetry
import torchtelemetry.export
from torchtelemetry import (
    ConsoleExporter,
    JsonlExporter,
    MLflowExporter,
    PrometheusExporter,
    PushgatewayExporter,
    TensorBoardExporter,
    WandbExporter,
)
from torchtelemetry.export import available_exporters, exporter_class, exporters_from_spec


def test_built_in_exporters_are_registered() -> None:
    known = available_exporters()
    built_in = {"console", "jsonl", "prometheus", "pushgateway", "otlp", "wandb", "tensorboard", "mlflow"}
    assert built_in <= set(known)
    assert exporter_class("prometheus") is PrometheusExporter
    assert exporter_class("pushgateway") is PushgatewayExporter
    assert exporter_class("wandb") is WandbExporter
    assert exporter_class("tensorboard") is TensorBoardExporter
    assert exporter_class("mlflow") is MLflowExporter


def test_exporters_from_spec_builds_in_order_with_options(tmp_path: Path) -> None:
    exporters = exporters_from_spec(
        " prometheus, jsonl,console ",
        prometheus={"port": 0},
        jsonl={"path": tmp_path / "m.jsonl"},
        pushgateway={"url": "127.0.0.1:9091"},  # known but not in the spec: ignored
    )
    assert [type(e) for e in exporters] == [PrometheusExporter, JsonlExporter, ConsoleExporter]
    assert exporters[0].port == 0 and exporters[0].url is None  # built, nothing opened
    assert exporters[1].path == tmp_path / "m.jsonl"
    assert [type(e) for e in exporters_from_spec(["console"])] == [ConsoleExporter]
    assert exporters_from_spec("") == []


def _install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A package `myplugin` declaring `MyExporter` as exporter `name`, as an install publishes it."""
    (tmp_path / "myplugin.py").write_text(
        "class MyExporter:\n    def __init__(self, level=1):\n        self.name, self.level = 'mine', level\n"
    )
    dist = tmp_path / "myplugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[torchtelemetry.exporters]\n{name} = myplugin:MyExporter\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_unknown_names_and_bad_options_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install_plugin(tmp_path, monkeypatch, "csv")  # listed between "console" and "jsonl"
    known = re.escape(", ".join(available_exporters()))  # whatever is installed, by name
    with pytest.raises(
        ValueError, match=rf"unknown exporter\(s\) \['promethues'\].*known exporters are {known}$"
    ):
        exporters_from_spec("promethues")
    with pytest.raises(ValueError, match=r"\['jsnol'\]"):
        exporters_from_spec("console", jsnol={"path": "x"})
    with pytest.raises(ValueError, match="more than once"):
        exporters_from_spec("console,console")
    with pytest.raises(TypeError, match=r"exporter 'pushgateway' with options \{\}"):
        exporters_from_spec("pushgateway")  # url is required
    with pytest.raises(ValueError, match="unknown; known exporters are"):
        exporter_class("nope")


def test_third_party_exporters_are_found_through_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_plugin(tmp_path, monkeypatch, "mine")
    (exporter,) = exporters_from_spec("mine", mine={"level": 3})
    assert (type(exporter).__module__, exporter.level) == ("myplugin", 3)


def test_public_names() -> None:
    for name in ("PrometheusExporter", "PushgatewayExporter", "ConsoleExporter", "JsonlExporter"):
        assert name in torchtelemetry.__all__ and name in torchtelemetry.export.__all__
        assert getattr(torchtelemetry, name) is getattr(torchtelemetry.export, name)
    for name in ("ExportHub", "NullHub", "ExporterHealth", "exporters_from_spec"):
        assert name in torchtelemetry.export.__all__ and name not in torchtelemetry.__all__
    assert {"available_exporters", "exporter_class"} <= set(torchtelemetry.export.__all__)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_needs_no_exporter_dependency_and_missing_ones_name_the_extra() -> None:
    lazy = run_python("import sys, torchtelemetry; print('prometheus_client' in sys.modules)")
    assert (lazy.returncode, lazy.stdout.strip()) == (0, "False"), lazy.stderr
    missing = run_python(
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import torchtelemetry as tt\n"
        "for build in (lambda: tt.PrometheusExporter(), lambda: tt.PushgatewayExporter('127.0.0.1:9091')):\n"
        "    try:\n        build()\n    except ImportError as error:\n        print(error)\n"
    )
    assert missing.returncode == 0, missing.stderr
    assert missing.stdout.count("pip install 'torchtelemetry[prometheus]'") == 2


def test_the_entry_points_pyproject_declares_build_every_exporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyproject's entry points as an install would publish them (a dist-info earlier on the path)."""
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["torchtelemetry.exporters"]
    version = torchtelemetry.__version__  # pyproject reads it from _version.py
    dist = tmp_path / f"torchtelemetry-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchtelemetry\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in declared.items())
    (dist / "entry_points.txt").write_text(f"[torchtelemetry.exporters]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert set(available_exporters()) >= set(declared) >= {"tensorboard", "mlflow", "wandb", "prometheus"}
    for name in declared:
        assert exporter_class(name).__name__ in torchtelemetry.export.__all__
    tensorboard, mlflow = exporters_from_spec(
        "tensorboard,mlflow", tensorboard={"log_dir": tmp_path / "tb"}, mlflow={"experiment_name": "spec"}
    )
    assert (type(tensorboard), tensorboard.log_dir) == (torchtelemetry.TensorBoardExporter, tmp_path / "tb")
    assert (type(mlflow), mlflow.experiment_name) == (torchtelemetry.MLflowExporter, "spec")
    assert not (tmp_path / "tb").exists()  # built, nothing opened


def test_options_ride_the_spec_string(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    prometheus, jsonl = exporters_from_spec(
        f"prometheus(port=0, addr='127.0.0.1'), jsonl(path={str(path)!r})"
    )
    assert (type(prometheus), prometheus.port, type(jsonl), Path(jsonl.path)) == (
        PrometheusExporter,
        0,
        JsonlExporter,
        path,
    )
    (console,) = exporters_from_spec("console()", console={})
    assert type(console) is ConsoleExporter


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("prometheus(port=)", "cannot read"),
        ("prometheus(9464)", r"not an exporter name or name\(key=value, \.\.\.\): 'prometheus\(9464\)'"),
        ("jsonl(path=metrics.jsonl)", "option path=metrics.jsonl of 'jsonl' is not a literal: quote strings"),
        ("prometheus(**{'port': 1})", r"\*\*options of 'prometheus'"),
        ("prometheus(port=1), prometheus", "more than once"),
    ],
)
def test_a_spec_string_that_cannot_be_read_says_how_to_write_it(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        exporters_from_spec(spec)
    with pytest.raises(ValueError, match=r"has \['port'\] in .* and as arguments"):
        exporters_from_spec("prometheus(port=1)", prometheus={"port": 2})
