"""StopOnSignal on real gloo ranks that receive real signals: every rank leaves the loop at the same
step, the last partial window is exported, and nothing raises."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed import run_ranks

WORLD_SIZE = 3
EVERY = 4
TOKENS = 8.0
MAX_STEPS = 5000
"""A rank that never stops fails the test instead of running forever."""


def _train(rank: int, world_size: int, out: str) -> tuple[int, int]:
    """The README's loop shape with a StopOnSignal; (last step trained, exit code)."""
    import torch

    import torchtelemetry as tt

    tokens = tt.SumMetric(kind="counter")
    exporters = [tt.JsonlExporter(Path(out) / "metrics.jsonl")]
    telemetry = tt.Telemetry({"tokens": tokens}, exporters, every=EVERY, signals=False)
    last = -1
    with tt.StopOnSignal(every=EVERY, timeout_s=60) as stop:
        (Path(out) / f"pid{rank}").write_text(str(os.getpid()))
        for step in range(MAX_STEPS):
            if stop.agreed():
                break
            tokens.update(torch.tensor(TOKENS))
            telemetry.step(step)
            last = step
            time.sleep(0.005)
    telemetry.close()
    return last, stop.exit_code


def _reports(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("signum", "receivers"),
    [(signal.SIGTERM, [1]), (signal.SIGINT, [0, 1, 2]), (signal.SIGTERM, [2, 0])],
    ids=["sigterm-to-one-rank", "ctrl-c-to-every-rank", "sigterm-to-two-ranks"],
)
def test_every_rank_stops_at_the_same_step_and_the_last_window_is_exported(
    tmp_path: Path, signum: signal.Signals, receivers: list[int]
) -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        ranks = pool.submit(run_ranks, _train, WORLD_SIZE, str(tmp_path), timeout_s=180)
        deadline = time.monotonic() + 120
        while len(_reports(tmp_path)) < 3 or not all((tmp_path / f"pid{r}").exists() for r in receivers):
            assert not ranks.done(), ranks.result()
            assert time.monotonic() < deadline, "the ranks did not start training"
            time.sleep(0.05)
        for rank in receivers:  # one after the other, as signals arrive: at different steps
            os.kill(int((tmp_path / f"pid{rank}").read_text()), signum)
        results = ranks.result()

    steps = {last for last, _ in results}
    assert len(steps) == 1, f"the ranks stopped at different steps: {results}"
    (last,) = steps
    assert 0 < last < MAX_STEPS - 1
    assert {code for _, code in results} == {128 + signum}
    reports = _reports(tmp_path)
    assert reports[-1]["step"] == last, "the last partial window is exported"
    assert reports[-1]["values"]["tokens"] == (last + 1) * TOKENS * WORLD_SIZE, "nothing lost"


def _build_with(rank: int, world_size: int, settings: list[dict[str, float]]) -> str:
    """Build a StopOnSignal with this rank's settings; the error it raises, or "built"."""
    import torchtelemetry as tt

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with tt.StopOnSignal(**settings[rank]):  # type: ignore[arg-type]
            return "built"
    except ValueError as error:
        assert signal.getsignal(signal.SIGTERM) is previous, "no handler left installed"
        return str(error)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (
            [{"every": 10, "timeout_s": 30}, {"every": 5, "timeout_s": 30}],
            "rank 0: every=10, timeout_s=30, rank 1: every=5, timeout_s=30",
        ),
        (
            [{"every": 4, "timeout_s": 30}, {"every": 4, "timeout_s": 45}],
            "rank 0: every=4, timeout_s=30, rank 1: every=4, timeout_s=45",
        ),
    ],
    ids=["every", "timeout_s"],
)
def test_every_and_timeout_s_that_differ_across_ranks_raise_on_every_rank(
    settings: list[dict[str, float]], named: str
) -> None:
    errors = run_ranks(_build_with, 2, settings, timeout_s=120)
    for error in errors:
        assert "StopOnSignal: every and timeout_s must be the same on every rank" in error
        assert named in error
    assert run_ranks(_build_with, 2, [settings[0], settings[0]], timeout_s=120) == ["built", "built"]


def test_a_single_process_stops_at_the_next_step(tmp_path: Path) -> None:
    import torch

    import torchtelemetry as tt

    tokens = tt.SumMetric(kind="counter")
    telemetry = tt.Telemetry(
        {"tokens": tokens}, [tt.JsonlExporter(tmp_path / "m.jsonl")], every=EVERY, signals=False
    )
    previous = signal.getsignal(signal.SIGTERM)
    with tt.StopOnSignal(every=EVERY) as stop:
        for step in range(100):
            if stop.agreed():
                break
            tokens.update(torch.tensor(TOKENS))
            telemetry.step(step)
            if step == 6:
                signal.raise_signal(signal.SIGTERM)
    telemetry.close()
    assert signal.getsignal(signal.SIGTERM) is previous, "the previous handler is back"
    assert (step, stop.exit_code) == (7, 128 + signal.SIGTERM)
    reports = _reports_at(tmp_path / "m.jsonl")
    assert reports[-1]["step"] == 6 and reports[-1]["values"]["tokens"] == 7 * TOKENS


def _reports_at(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
