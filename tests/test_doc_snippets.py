"""Every Python snippet in README.md and docs/ passes the repository's own `ruff check` (its
`pyproject.toml` rules), so what users copy is what the project would accept. Names a snippet
takes from the prose around it (`model`, `loader`, a `telemetry` built a section earlier) are
allowed: F821 is the one rule not applied."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = {
    f"{page.relative_to(ROOT)}#{index}": code
    for page in PAGES
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL))
}


def test_the_pages_hold_snippets() -> None:
    assert len(SNIPPETS) >= 15, sorted(SNIPPETS)


@pytest.mark.parametrize("where", sorted(SNIPPETS))
def test_snippet_passes_ruff(where: str) -> None:
    stem = re.sub(r"\W", "_", where)
    ruff = [sys.executable, "-m", "ruff", "check", "--ignore", "F821"]
    done = subprocess.run(
        [*ruff, "--stdin-filename", f"docs/{stem}.py", "-"],
        input=SNIPPETS[where],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{where}:\n{done.stdout}{done.stderr}"
