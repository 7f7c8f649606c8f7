"""`torchtelemetry stack`: the package's copy of the stack is the repository's, written as it is
or with the scrape targets moved to where the trainer, the Pushgateway and the Collector run.

Run from the source tree or an editable install (as `make test` runs), the package's files are
the repository's through the links in src/torchtelemetry/stack-files/; test_install.py checks
what a built wheel holds.
"""

from __future__ import annotations

import inspect
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("yaml")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

import yaml

from tests.package._files import ROOT, STACK_PARTS, repository_stack, written
from torchtelemetry import PrometheusExporter, stack
from torchtelemetry.cli import main
from torchtelemetry.stack import stack_files, write_stack


def prometheus_configs(files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """The Prometheus configs among `files`, parsed."""
    parsed = {name: yaml.safe_load(data) for name, data in files.items() if name.endswith((".yml", ".yaml"))}
    return {
        name: config
        for name, config in parsed.items()
        if isinstance(config, dict) and "scrape_configs" in config
    }


def targets(config: dict[str, Any]) -> dict[str, list[str]]:
    """Scrape targets by job."""
    return {
        job["job_name"]: [target for static in job.get("static_configs", []) for target in static["targets"]]
        for job in config["scrape_configs"]
    }


def test_the_package_links_to_the_repository_files() -> None:
    links = Path(stack.__file__).parent / "stack-files"
    for part in STACK_PARTS:
        assert (links / part).is_symlink(), f"stack-files/{part} must link to the repository's {part}"
        assert (links / part).resolve() == (ROOT / part).resolve()
    assert {name: source.read_bytes() for name, source in stack_files()} == repository_stack()


def test_the_trainer_port_is_the_exporters_default() -> None:
    assert inspect.signature(PrometheusExporter).parameters["port"].default == stack.METRICS_PORT


def test_the_stack_written_with_defaults_is_the_repositorys(tmp_path: Path, capsys) -> None:
    assert main(["stack", "--out", str(tmp_path / "stack")]) == 0
    assert written(tmp_path / "stack") == repository_stack()
    assert f"cd {tmp_path / 'stack'} && docker compose up -d" in capsys.readouterr().out


def test_flags_move_the_scrape_targets_outside_the_compose_stack(tmp_path: Path) -> None:
    write_stack(
        tmp_path, metrics_host="node7", metrics_port=9500, pushgateway="http://gw:9092", collector="col:18889"
    )
    files, repository = written(tmp_path), repository_stack()
    configs = prometheus_configs(files)
    docker, host = (
        configs["exporters/prometheus/prometheus.yml"],
        configs["exporters/prometheus/prometheus-host.yml"],
    )
    assert targets(docker) == targets(
        prometheus_configs(repository)["exporters/prometheus/prometheus.yml"]
    ) | {
        "torchtelemetry": ["node7:9500"]  # the compose stack's own gateway and collector stay
    }
    assert targets(host) == targets(
        prometheus_configs(repository)["exporters/prometheus/prometheus-host.yml"]
    ) | {
        "torchtelemetry": ["node7:9500"],
        "torchtelemetry-pushgateway": ["gw:9092"],
        "torchtelemetry-otel-collector": ["col:18889"],
    }
    for name in files.keys() - configs.keys():
        assert files[name] == repository[name], f"{name} changed although it is no Prometheus config"
    for name in configs:  # nothing but the targets changed: comments and layout stay
        changed = [
            (old, new)
            for old, new in zip(
                repository[name].decode().splitlines(), files[name].decode().splitlines(), strict=True
            )
            if old != new
        ]
        assert all("targets:" in old for old, _new in changed), changed


def test_promtool_accepts_every_prometheus_config_written_with_flags(tmp_path: Path, promtool: str) -> None:
    write_stack(tmp_path, metrics_port=9500, pushgateway="gw:9092", collector="col:18889")
    for name in prometheus_configs(written(tmp_path)):
        result = subprocess.run(
            [promtool, "check", "config", str(tmp_path / name)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


AGENT = """\
# A config the package learns about only by shipping it: targets in every YAML list style.
scrape_configs:
  - job_name: torchtelemetry
    static_configs:
      - targets:
          - 127.0.0.1:9464  # rank 0
          - 'localhost:9091'
      - targets: [other-host:9464, "127.0.0.1:9100"]
  - job_name: collector
    static_configs:
      - labels: {route: otlp}
        targets: [
          "127.0.0.1:8889",
        ]
  - job_name: indentless
    static_configs:
      - targets:
        - host.docker.internal:9464
remote_write:
  - url: http://127.0.0.1:8428/api/v1/write
"""


def test_a_new_prometheus_config_gets_the_same_targets(tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped"
    (shipped / "exporters" / "prometheus").mkdir(parents=True)
    (shipped / "exporters" / "prometheus" / "prometheus-agent.yml").write_text(AGENT)
    monkeypatch.setattr(stack, "_files", lambda: shipped)

    write_stack(tmp_path / "out", metrics_port=9500, pushgateway="gw:9092", collector="col:18889")

    text = (tmp_path / "out" / "exporters" / "prometheus" / "prometheus-agent.yml").read_text()
    config = yaml.safe_load(text)
    assert targets(config) == {
        "torchtelemetry": ["127.0.0.1:9500", "gw:9092", "other-host:9464", "127.0.0.1:9100"],
        "collector": ["col:18889"],
        "indentless": ["host.docker.internal:9500"],
    }
    assert config["remote_write"] == yaml.safe_load(AGENT)["remote_write"]
    assert "127.0.0.1:9500  # rank 0\n" in text


def test_a_flag_no_shipped_config_uses_is_an_error(tmp_path: Path, monkeypatch) -> None:
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "prometheus.yml").write_text(AGENT.split("  - job_name: collector")[0])  # no collector
    monkeypatch.setattr(stack, "_files", lambda: shipped)
    with pytest.raises(
        ValueError, match=r"collector: no Prometheus config in the package scrapes .* port 8889"
    ):
        write_stack(tmp_path / "out", collector="col:18889")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("pushgateway", "https://gw:9091", "pushgateway: expected HOST:PORT or http://HOST:PORT"),
        ("collector", "col", "collector: expected HOST:PORT"),
        ("pushgateway", "gw:70000", "pushgateway: expected HOST:PORT"),
        ("metrics_port", 0, "metrics_port: must be in 1..65535"),
        ("metrics_host", "node7:9464", "metrics_host: expected a host name or an IP address"),
    ],
)
def test_a_bad_address_is_an_error_naming_it(tmp_path: Path, option: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_stack(tmp_path, **{option: value})
    assert not any(tmp_path.iterdir())


def test_files_already_there_are_kept_unless_overwritten(tmp_path: Path, capsys) -> None:
    (tmp_path / "docker-compose.yml").write_text("mine\n")
    with pytest.raises(SystemExit) as exit_:
        main(["stack", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "already holds docker-compose.yml" in capsys.readouterr().err
    assert (tmp_path / "docker-compose.yml").read_text() == "mine\n"
    assert sorted(tmp_path.iterdir()) == [tmp_path / "docker-compose.yml"], "nothing written"

    assert main(["stack", "--out", str(tmp_path), "--force"]) == 0
    assert written(tmp_path) == repository_stack()


def test_nothing_is_written_outside_the_directory_through_a_symbolic_link(tmp_path: Path, capsys) -> None:
    outside, out = tmp_path / "outside", tmp_path / "out"
    outside.mkdir()
    out.mkdir()
    (out / "docker-compose.yml").symlink_to(outside / "planted.yml")  # dangling: exists() says False
    (out / "dashboards").symlink_to(outside, target_is_directory=True)
    for force in ([], ["--force"]):
        with pytest.raises(SystemExit) as exit_:
            main(["stack", "--out", str(out), *force])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err  # one line, no usage dump, no traceback
        assert f"{out / 'dashboards'}, {out / 'docker-compose.yml'}" in err and "symbolic links" in err
    assert not any(outside.iterdir()), "nothing written through the links"
    assert sorted(out.iterdir()) == [out / "dashboards", out / "docker-compose.yml"], "nothing written"


def test_out_naming_a_file_is_one_line_naming_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("mine\n")
    with pytest.raises(SystemExit) as exit_:
        main(["stack", "--out", str(tmp_path / "file")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"torchtelemetry stack: error: out: {tmp_path / 'file'} is not a directory; " + (
        "name a directory to write into\n"
    )
    assert (tmp_path / "file").read_text() == "mine\n"
