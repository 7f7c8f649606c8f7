"""What a release carries besides code: one version everywhere, its changelog entry, the licence
pyproject declares, type information, and `torchtelemetry --version`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchtelemetry
from torchtelemetry.cli import main

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once() -> None:
    project = pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "torchtelemetry._version.__version__"


def test_the_changelog_starts_with_the_current_version() -> None:
    versions = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert versions, "CHANGELOG.md has no `## [version]` entry"
    assert versions[0] == torchtelemetry.__version__, (
        f"CHANGELOG.md's newest entry is {versions[0]}, the package is {torchtelemetry.__version__}"
    )


def test_the_licence_file_is_the_apache_licence_pyproject_declares() -> None:
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(re.findall(r"^\s+\d+\. [A-Z]", text, re.MULTILINE)) == 9  # sections 1 to 9


def test_the_package_says_it_is_typed() -> None:
    assert (Path(torchtelemetry.__file__).parent / "py.typed").is_file()
    assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"]["torchtelemetry"]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_the_command_prints_its_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"torchtelemetry {torchtelemetry.__version__}\n"


def test_the_version_and_the_usage_answer_without_importing_torch() -> None:
    code = (
        "import sys\nfrom torchtelemetry.cli import main\n"
        "main(['--version']); main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"torchtelemetry {torchtelemetry.__version__}"
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_public_name_and_a_subpackage_load_on_first_use() -> None:
    code = (
        "import sys, torchtelemetry as tt\nassert 'torch' not in sys.modules\n"
        "print(tt.Telemetry.__module__, tt.metric.__name__, sorted(set(tt.__all__) - set(dir(tt))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torchtelemetry.telemetry", "torchtelemetry.metric", "[]"]
