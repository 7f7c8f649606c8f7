"""Shared fixtures: real servers on 127.0.0.1 (see tests/servers.py), stopped at teardown."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import PrometheusServer, PushgatewayServer, VictoriaMetricsServer, binary


@pytest.fixture(autouse=True, scope="session")
def _evidence_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Captures and hang stacks of runs that name no `dump_dir` go to a temporary directory, not into
    the checkout (ranks and demo processes inherit the environment)."""
    os.environ.setdefault("TORCHTELEMETRY_DUMP_DIR", str(tmp_path_factory.mktemp("dumps")))


def _require(name: str) -> str:
    path = binary(name)
    if path is None:
        pytest.skip(
            f"{name} is not installed (make system-deps installs Debian's prometheus, "
            "prometheus-pushgateway and victoria-metrics)"
        )
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusServer]:
    """A Prometheus (1 s scrape) not yet started: add jobs with `.scrape(...)`, then `.start()`."""
    _require("prometheus")
    server = PrometheusServer(tmp_path / "prometheus")
    yield server
    server.stop()


@pytest.fixture
def pushgateway(tmp_path: Path) -> Iterator[PushgatewayServer]:
    """A running Pushgateway."""
    _require("prometheus-pushgateway")
    with PushgatewayServer(tmp_path / "pushgateway") as server:
        yield server


@pytest.fixture
def victoriametrics(tmp_path: Path) -> Iterator[VictoriaMetricsServer]:
    """A running single-node VictoriaMetrics (remote write in, Prometheus query API out)."""
    _require("victoria-metrics")
    with VictoriaMetricsServer(tmp_path / "victoria-metrics") as server:
        yield server


@pytest.fixture
def promtool() -> str:
    """Path of `promtool`."""
    return _require("promtool")
