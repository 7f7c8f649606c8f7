"""Launch a test script on 2 CPU processes with torchrun, offline, from the repository's sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def run_two_ranks(script: str, out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`torchrun(script, out)` on 2 ranks; then what each rank recorded (`rank<r>.json`) and the
    reports exported to `telemetry-rank0.jsonl`, after checking rank 1 exported nothing."""
    torchrun(script, out)
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert not (out / "telemetry-rank1.jsonl").exists(), "only rank 0 exports"
    with open(out / "telemetry-rank0.jsonl", encoding="utf-8") as file:
        return ranks, [json.loads(line) for line in file]
