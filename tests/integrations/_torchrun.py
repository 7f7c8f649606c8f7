"""Launch a test script on 2 CPU processes with torchrun, offline, from the repository's sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str, out: Path, *, nproc: int = 2, timeout_s: float = 240) -> None:
    """Run `tests/integrations/<script> <out>` on `nproc` processes; fail with its output if it fails."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / "tests" / "integrations" / script),
        str(out),
    ]
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
