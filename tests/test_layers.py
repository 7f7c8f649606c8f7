"""The import contracts of .importlinter: kept by the source, and broken by the imports they forbid."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "torchtelemetry"


def lint_imports(source_root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter with the repository's contracts on the package under `source_root`."""
    config = str(ROOT / ".importlinter")
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={config!r}, no_cache=True, no_logo=True))"
    )
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=source_root, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_source_keeps_every_contract() -> None:
    result = lint_imports(PACKAGE.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_a_private_import_and_an_unplaced_module_break_the_contracts(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "torchtelemetry", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "torchtelemetry" / "report" / "_values.py", "a") as module:
        module.write("\nfrom torchtelemetry.telemetry import Telemetry\n")
    with open(tmp_path / "torchtelemetry" / "sync" / "_buckets.py", "a") as module:
        module.write("\nfrom torchtelemetry.metric import Metric\n")  # the cycle Metric.sync() once made
    with open(tmp_path / "torchtelemetry" / "telemetry.py", "a") as module:
        module.write("\nfrom torchtelemetry.export._hub import ExportHub\n")
    (tmp_path / "torchtelemetry" / "helpers.py").write_text('"""Not placed in any layer."""\n')

    result = lint_imports(tmp_path)

    assert result.returncode == 1, result.stdout + result.stderr
    assert "torchtelemetry.report is not allowed to import torchtelemetry.telemetry" in result.stdout
    assert "torchtelemetry.sync is not allowed to import torchtelemetry.metric" in result.stdout
    assert "torchtelemetry.telemetry -> torchtelemetry.export._hub" in result.stdout
    assert "torchtelemetry.helpers" in result.stdout  # every top-level module must be placed in a layer


def test_report_importing_collect_breaks_its_own_contract(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "torchtelemetry", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "torchtelemetry" / "report" / "_flatten.py", "a") as module:
        module.write("\nfrom torchtelemetry.collect import CollectionError\n")  # allowed by the layers alone

    result = lint_imports(tmp_path)

    assert result.returncode == 1, result.stdout + result.stderr
    assert "Layers: each imports only the layers below it KEPT" in result.stdout
    assert "torchtelemetry.report is not allowed to import torchtelemetry.collect" in result.stdout
