"""What a pip user gets: the wheel and the sdist built from this checkout, the wheel installed with
the `prometheus` extra into a fresh virtual environment, then used as a user would: a training run
scraped once, `torchtelemetry stack`, promtool on the alert rules it wrote.

Built offline with this environment's setuptools (no build isolation), from a copy of the checkout
(what git tracks or would track, links kept) holding one file the package code has never heard
of, so a file added under exporters/ or dashboards/ ships without a code change. torch comes from
`pip install torch==2.13.0`, as the Makefile installs it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchtelemetry
from tests.distributed import free_port
from tests.package._files import ROOT, STACK_PARTS, repository_stack, written

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_FILE = "exporters/new-receiver/config.yaml"
"""Added to the copy of the checkout: it must ship, and `torchtelemetry stack` must write it."""
TORCH = "torch==2.13.0"
"""The Makefile's torch (the CPU wheel here and in CI)."""

TRAIN = """
import sys

import torch

import torchtelemetry as tt

metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
exporter = tt.PrometheusExporter(port=int(sys.argv[1]), linger_s=0)
telemetry = tt.Telemetry(metrics, [exporter], every=5, run_id="wheel")
for step in range(20):
    metrics["train"]["loss"].update(torch.tensor(float(step)))
    telemetry.step(step)
assert telemetry.flush()
print(tt.__file__, flush=True)
sys.stdin.readline()  # the test has scraped the endpoint
telemetry.close()
"""


def run(*command: str | Path, cwd: Path | None = None, timeout_s: float = 600) -> str:
    """stdout of `command`, run outside the source tree's reach (no PYTHONPATH); fails with its output."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def checkout_copy(destination: Path) -> Path:
    """What git tracks or would track in this checkout, links kept as links, plus `NEW_FILE`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source, target = ROOT / name, destination / name
        if not os.path.lexists(source):  # deleted, not yet committed
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    (destination / NEW_FILE).parent.mkdir(parents=True)
    (destination / NEW_FILE).write_text("# a receiver's config, new to the package code\nreceivers: {}\n")
    return destination


@dataclass(frozen=True)
class Dists:
    checkout: Path
    sdist: Path
    wheel: Path
    wheel_from_sdist: Path


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    base = tmp_path_factory.mktemp("dists")
    checkout = checkout_copy(base / "checkout")
    build_sdist = "import sys, setuptools.build_meta as backend; print(backend.build_sdist(sys.argv[1]))"
    sdist = base / "sdist" / run(sys.executable, "-c", build_sdist, base / "sdist", cwd=checkout).split()[-1]
    wheel_command = (sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation")
    run(*wheel_command, "--wheel-dir", base / "wheel", checkout)
    run(*wheel_command, "--wheel-dir", base / "wheel-from-sdist", sdist)
    (wheel,) = (base / "wheel").glob("*.whl")
    (wheel_from_sdist,) = (base / "wheel-from-sdist").glob("*.whl")
    return Dists(checkout, sdist, wheel, wheel_from_sdist)


def wheel_files(wheel: Path) -> dict[str, str]:
    """sha256 of every file in a wheel, by name."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: hashlib.sha256(archive.read(name)).hexdigest() for name in archive.namelist()}


def test_the_wheel_ships_the_stack_the_licence_and_the_type_marker(dists: Dists) -> None:
    version = torchtelemetry.__version__
    assert dists.wheel.name == f"torchtelemetry-{version}-py3-none-any.whl"
    prefix = "torchtelemetry/stack-files/"
    with zipfile.ZipFile(dists.wheel) as archive:
        names = archive.namelist()
        shipped = {name.removeprefix(prefix): archive.read(name) for name in names if name.startswith(prefix)}
        metadata = archive.read(f"torchtelemetry-{version}.dist-info/METADATA").decode()
        licence = archive.read(f"torchtelemetry-{version}.dist-info/licenses/LICENSE")
    assert shipped == repository_stack(dists.checkout)
    assert NEW_FILE in shipped and "dashboards/generate.py" not in shipped
    assert "torchtelemetry/py.typed" in names
    assert licence == (ROOT / "LICENSE").read_bytes()
    assert f"Version: {version}\n" in metadata and "License-Expression: Apache-2.0\n" in metadata
    assert "Provides-Extra: prometheus\n" in metadata


def test_the_sdist_builds_the_same_wheel(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as archive:
        members = {
            member.name.split("/", 1)[1]: member for member in archive.getmembers() if "/" in member.name
        }
    assert "LICENSE" in members and "src/torchtelemetry/py.typed" in members
    assert not any(member.issym() for member in members.values()), "the sdist holds copies, not links"
    assert wheel_files(dists.wheel_from_sdist) == wheel_files(dists.wheel)


@pytest.fixture(scope="module")
def venv(dists: Dists, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with torch and the wheel with the `prometheus` extra."""
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    run(sys.executable, "-m", "venv", venv)
    # --no-compile: byte-compiling all of torch would take most of the install's time
    run(venv / "bin" / "pip", "install", "--quiet", "--no-compile", TORCH, f"{dists.wheel}[prometheus]")
    run(venv / "bin" / "pip", "check")
    return venv


def test_a_training_run_from_the_installed_wheel_serves_a_scrape(venv: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    trainer = subprocess.Popen(
        [str(venv / "bin" / "python"), "-c", TRAIN, str(port)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdin is not None
        imported_from = trainer.stdout.readline().strip()
        assert imported_from.startswith(str(venv)), f"{imported_from!r}; stderr: {trainer.stderr}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            scrape = response.read().decode()
        trainer.stdin.write("scraped\n")
        trainer.stdin.flush()
        _, stderr = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
        trainer.wait()
    assert trainer.returncode == 0, stderr
    lines = scrape.splitlines()
    assert 'torchtelemetry_train_loss{route="scrape",run="wheel"} 17.0' in lines, scrape  # steps 15..19
    assert 'torchtelemetry_train_step{route="scrape",run="wheel"} 19.0' in lines, scrape


def test_the_installed_command_writes_a_stack_promtool_accepts(
    venv: Path, dists: Dists, tmp_path: Path, promtool: str
) -> None:
    command = venv / "bin" / "torchtelemetry"
    assert run(command, "--version", cwd=tmp_path) == f"torchtelemetry {torchtelemetry.__version__}\n"
    out = tmp_path / "stack"
    run(command, "stack", "--out", out, cwd=tmp_path)
    assert written(out) == repository_stack(dists.checkout)
    assert {path.name for path in out.iterdir()} == set(STACK_PARTS)

    prometheus = out / "exporters" / "prometheus"
    rules = run(promtool, "check", "rules", prometheus / "alerts.yml")
    assert "SUCCESS" in rules, rules
    assert "SUCCESS" in run(promtool, "test", "rules", prometheus / "alerts_test.yml")
    for config in ("prometheus.yml", "prometheus-host.yml"):
        assert "SUCCESS" in run(promtool, "check", "config", prometheus / config)
