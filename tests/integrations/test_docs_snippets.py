"""docs/integrations.md's snippets, pasted into a file and run under the launch the page prescribes.

Hugging Face, accelerate and torchtitan-style: `torchrun --nproc_per_node=2 snippet.py`; Lightning:
`python snippet.py` (it starts its two DDP ranks itself). Each must succeed and export what the page
says; the Hugging Face Trainer's logged loss is the true loss of the two ranks (our exact
`train/token_loss`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"
TORCHRUN = ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
REPORT = re.compile(r"\d\d:\d\d:\d\d step (\d+) \[[^\]]*\] (.*)$")
"""A console report, wherever it starts on a line (after a progress bar's carriage returns)."""


def snippet(section: str) -> str:
    """The python block of `## <section>`."""
    text = DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return code


def run(section: str, tmp_path: Path, *, torchrun: bool) -> tuple[list[tuple[int, dict[str, str]]], str]:
    """Run the section's snippet as the page says; the console reports, (step, {name: value}), and
    the end of its stderr (what a failed assertion shows: a dropped report says so there)."""
    (tmp_path / "snippet.py").write_text(snippet(section))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
    }
    launch = [*TORCHRUN, f"--master_port={free_port()}"] if torchrun else []
    done = subprocess.run(
        [sys.executable, *launch, "snippet.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    reports = []
    for line in done.stderr.splitlines():
        match = REPORT.search(line)
        if match:
            values = dict(re.findall(r"(\S+)=(\S+)", match.group(2)))
            reports.append((int(match.group(1)), values))
    assert reports, done.stderr[-3000:]
    return reports, done.stderr[-3000:]


@pytest.mark.slow
def test_lightning_snippet(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    reports, stderr = run("Lightning", tmp_path, torchrun=False)
    collected = [step for step, values in reports if "train/loss" in values]
    assert {10, 20, 30, 40, 50} <= set(collected), stderr  # and at each epoch end, for its checkpoint
    assert all("train/max_abs_error" in values for step, values in reports if step % 10 == 0)
    # self.log values at Lightning's own cadence (log_every_n_steps=50), under lightning/
    assert [step for step, values in reports if "lightning/train_loss" in values] == [50]


@pytest.mark.slow
def test_hugging_face_snippet_logs_the_true_loss_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    reports, stderr = run("Hugging Face Trainer", tmp_path, torchrun=True)
    logged = [values for _, values in reports if "hf/loss" in values and "train/token_loss" in values]
    assert len(logged) == 4, stderr  # logging_steps=5 over max_steps=20
    for values in logged:
        assert float(values["hf/loss"]) == pytest.approx(float(values["train/token_loss"]), rel=1e-3)
        assert float(values["hf/learning_rate"]) == float(values["train/learning_rate"])
    assert any("hf/train_samples_per_second" in values for _, values in reports)


@pytest.mark.slow
def test_accelerate_snippet(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    reports, stderr = run("accelerate", tmp_path, torchrun=True)
    assert [step for step, values in reports if "train/loss" in values][:3] == [10, 20, 30], stderr
    assert {step for step, values in reports if "lr" in values} == set(range(1, 33)), stderr  # 512 / 8 / 2
    waits = [name for _, values in reports for name in values if name.startswith("train/sync_wait")]
    assert waits, reports  # the loop measures each rank's wait in DDP's all-reduce


@pytest.mark.slow
def test_torchtitan_style_snippet(tmp_path: Path) -> None:
    reports, stderr = run("torchtitan-style loops", tmp_path, torchrun=True)
    assert [step for step, values in reports if "train/loss" in values] == list(range(10, 101, 10)), stderr
    logged = [step for step, values in reports if "loss_metrics/global_avg_loss" in values]
    assert logged == [1, *range(10, 101, 10)]
