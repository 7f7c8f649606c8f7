"""The stack's files as the repository holds them and as `torchtelemetry stack` writes them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STACK_PARTS = ("docker-compose.yml", "exporters", "dashboards")
"""What the package ships, relative to the repository's root."""


def repository_stack(root: Path = ROOT) -> dict[str, bytes]:
    """Every file of the stack in a checkout at `root`, by path: what the package must ship
    (dashboards/generate.py writes a dashboard and stays out)."""
    found = {}
    for part in STACK_PARTS:
        path = root / part
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            relative = file.relative_to(root)
            hidden = any(name.startswith(".") or name == "__pycache__" for name in relative.parts)
            if file.is_file() and not hidden and file.suffix not in (".py", ".pyc"):
                found[relative.as_posix()] = file.read_bytes()
    return found


def written(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by path relative to it."""
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
