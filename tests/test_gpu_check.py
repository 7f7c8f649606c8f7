"""`make gpu-check` on the GPU image this project may be lent (python3, torch with CUDA, pytest, numpy,
prometheus-client; no venv, no pip, no hypothesis, no yaml, no network), simulated here: only those
packages are importable, and no CUDA device is visible. It must collect every cuda test without an
import error and exit 2 naming the missing device."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ["torch", "numpy", "pytest", "prometheus_client"]
"""What the GPU image has besides the standard library (with what they need to import)."""
NEEDED_BY_IMAGE = [
    *("torchgen", "functorch", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec"),
    *("typing_extensions", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments"),
]


def _image_site(site: Path) -> Path:
    """A site directory holding only the image's packages (links to this interpreter's copies)."""
    site.mkdir()
    for name in IMAGE + NEEDED_BY_IMAGE:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        path = Path(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin)  # type: ignore[arg-type]
        (site / path.name).symlink_to(path)
        for info in path.parent.glob(f"{name.replace('_', '-')}-*.dist-info"):
            (site / info.name).symlink_to(info)
    return site


def test_gpu_check_on_the_gpu_image_without_a_device_collects_every_cuda_test_and_exits_2(
    tmp_path: Path,
) -> None:
    site = _image_site(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{site}", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_ADDOPTS", None)
    completed = subprocess.run(
        [sys.executable, "-S", "-m", "bench.gpu_check"],  # -S: no site-packages but the image's
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 2, output[-3000:]
    found = re.search(r"gpu-check: (\d+) cuda tests collected, every test module imports; no CUDA", output)
    assert found, output[-3000:]
    assert int(found[1]) >= 15


def test_make_gpu_check_needs_no_venv_and_no_pip() -> None:
    command = ["make", "--no-print-directory", "-n", "-B", "gpu-check", "PYTHON=python3"]  # -B: nothing built
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry_run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert dry_run.strip() == "PYTHONPATH=src python3 -m bench.gpu_check"


def test_every_test_that_needs_cuda_carries_the_cuda_mark() -> None:
    for path in (ROOT / "tests").rglob("test_*.py"):
        source = path.read_text()
        if "skipif(not torch.cuda.is_available()" in source:
            assert "pytest.mark.cuda" in source, f"{path.relative_to(ROOT)} skips without CUDA, no cuda mark"
