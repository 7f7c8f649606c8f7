"""`torchtelemetry demo` as a process of its own, for the tests that watch it run."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


@contextlib.contextmanager
def demo_process(
    args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`python -m torchtelemetry.demo *args` in `cwd` (where its runs/ goes), its stdout and stderr
    in one text pipe; killed at the end if it is still running."""
    process = subprocess.Popen(
        [sys.executable, "-m", "torchtelemetry.demo", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
