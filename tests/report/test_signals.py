"""Built-in signals on real gloo ranks: model FLOPs, data wait, straggler ranks, allocator memory."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from torchtelemetry.report import PEAK_FLOPS, peak_flops_of

EVERY = 3
STEPS = 7  # windows end at steps 2, 5; close() exports the partial window ending at 6
FLOPS_PER_TOKEN = 6e9
PEAK = 1e15


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tokens(rank: int) -> int:
    return 100 * (rank + 1)


def _data_time(rank: int, step: int) -> float:
    return 0.001 * (rank + 1) * (step + 1)


def _train_with_flops_and_data_wait(rank: int, world_size: int, path: str) -> None:
    telemetry = tt.Telemetry(
        {"train": {"loss": tt.WeightedMeanMetric()}},
        [tt.JsonlExporter(path)],
        every=EVERY,
        run_id="signals",
        flops_per_token=FLOPS_PER_TOKEN,
        peak_flops=PEAK,
    )
    for step in range(STEPS):
        time.sleep(_data_time(rank, step) + 0.002)  # the wait, then the step's own work
        telemetry.metrics["train"]["loss"].update(torch.tensor(1.0), 1)
        telemetry.step(step, tokens=_tokens(rank), data_time=_data_time(rank, step))
    telemetry.close()


@pytest.mark.timeout(180)
def test_mfu_tflops_and_data_wait_follow_torchtitans_formulas_on_two_ranks(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    run_ranks(_train_with_flops_and_data_wait, 2, str(path))
    lines = _read_jsonl(path)
    windows = [range(0, 3), range(3, 6), range(6, 7)]
    assert [line["step"] for line in lines] == [steps[-1] for steps in windows]
    tokens_before = 0.0
    for line, steps in zip(lines, windows, strict=True):
        values = line["values"]
        window_tokens = values["train/tokens"] - tokens_before
        tokens_before = values["train/tokens"]
        assert window_tokens == sum(_tokens(rank) for rank in range(2)) * len(steps)
        # torchtitan: tps per device = tokens / (time_delta * devices); tflops = F * tps / 1e12;
        # mfu = 100 * F * tps / peak. The window's duration is tokens over tokens per second.
        tps = values["train/tokens_per_second"] / 2
        assert values["train/tflops_per_second"] == pytest.approx(FLOPS_PER_TOKEN * tps / 1e12, rel=1e-12)
        assert values["train/mfu"] == pytest.approx(100 * FLOPS_PER_TOKEN * tps / PEAK, rel=1e-12)
        for rank in range(2):
            expected_wait = sum(_data_time(rank, step) for step in steps) / len(steps)
            assert values["train/data_wait"][str(rank)] == pytest.approx(expected_wait, rel=1e-12)
        # Rank 0 exported the report, so its window duration is the one throughput divides by.
        duration = window_tokens / values["train/tokens_per_second"]
        rank0_wait = sum(_data_time(0, step) for step in steps)
        assert values["train/data_wait_share"]["0"] == pytest.approx(100 * rank0_wait / duration, rel=1e-9)
        assert 0 < values["train/data_wait_share"]["1"] < 100
        step_times = values["train/step_time"]  # one series per rank, and the extremes' ranks too
        assert values["train/step_time/max_rank"] == float(max(step_times, key=step_times.get))
        assert values["train/step_time/min_rank"] == float(min(step_times, key=step_times.get))


def _train_with_a_slow_rank(rank: int, world_size: int, path: str, slow: int) -> None:
    telemetry = tt.Telemetry({}, [tt.JsonlExporter(path)], every=2, max_rank_series=0, run_id="straggler")
    for step in range(4):
        time.sleep(0.15 if rank == slow else 0.0)
        telemetry.step(step, data_time=0.01 * (rank + 1))
    telemetry.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("slow", [0, 1])
def test_above_the_rank_series_limit_the_slowest_and_fastest_ranks_are_named(
    tmp_path: Path, slow: int
) -> None:
    path = tmp_path / "metrics.jsonl"
    run_ranks(_train_with_a_slow_rank, 2, str(path), slow)
    lines = _read_jsonl(path)
    assert [line["step"] for line in lines] == [1, 3]
    for line in lines:
        values = line["values"]
        assert "train/step_time" not in values and "train/data_wait" not in values
        assert values["train/step_time/max_rank"] == slow
        assert values["train/step_time/min_rank"] == 1 - slow
        assert values["train/step_time/max"] > values["train/step_time/min"]
        assert values["train/data_wait/min"] == pytest.approx(0.01)
        assert values["train/data_wait/max"] == pytest.approx(0.02)
        assert values["train/data_wait/median"] == pytest.approx(0.015)


def test_data_wait_context_manager_times_the_block_and_unmarked_runs_export_no_data_wait() -> None:
    telemetry = tt.Telemetry({}, [], every=2)
    for step in range(2):
        with telemetry.data_wait():
            time.sleep(0.02)
        telemetry.step(step)
    telemetry.flush()
    assert telemetry.latest["train/data_wait"]["0"] >= 0.02
    assert 0 < telemetry.latest["train/data_wait_share"]["0"] <= 100
    telemetry.close()

    unmarked = tt.Telemetry({}, [], every=2)
    for step in range(2):
        unmarked.step(step)
    unmarked.close()
    assert "train/data_wait" not in unmarked.latest and "train/data_wait_share" not in unmarked.latest


def test_a_bad_data_time_names_the_signal_and_loses_nothing() -> None:
    telemetry = tt.Telemetry({}, [], every=2)
    telemetry.step(0, data_time=0.5)
    with pytest.raises(ValueError, match=r"train/data_wait.*-1"):
        telemetry.step(1, data_time=-1.0)
    with pytest.raises(TypeError, match=r"train/data_wait: data wait must be host seconds.*Tensor"):
        telemetry.step(1, data_time=torch.tensor(0.1))  # type: ignore[arg-type]
    telemetry.step(1)
    telemetry.close()
    assert telemetry.latest["train/data_wait"]["0"] == 0.25


@pytest.mark.parametrize(
    "bad",
    ["0.1", [0.1], True, torch.tensor([0.1, 0.2]), torch.tensor(0.1, device="meta")],
    ids=["string", "list", "bool", "vector", "device tensor"],
)
def test_a_bad_learning_rate_names_the_signal_and_loses_nothing(bad: Any) -> None:
    """Refused before anything of the step is recorded: the tokens given with it are not counted."""
    telemetry = tt.Telemetry({}, [], every=2)
    telemetry.step(0, tokens=10, learning_rate=0.5)
    with pytest.raises(
        TypeError, match=r"train/learning_rate: step\(learning_rate=\) takes a number.*nothing"
    ):
        telemetry.step(1, tokens=1000, learning_rate=bad)
    telemetry.step(1, tokens=10, learning_rate=torch.tensor(0.25))
    telemetry.close()
    assert telemetry.latest["train/learning_rate"] == 0.25
    assert telemetry.latest["train/tokens"] == 20


def test_flops_configuration_is_checked_and_mfu_needs_a_known_peak(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="flops_per_token and flops_per_sample are both set"):
        tt.TelemetryConfig(flops_per_token=1e9, flops_per_sample=1e12)
    with pytest.raises(ValueError, match=r"TelemetryConfig\.peak_flops must be a positive number"):
        tt.TelemetryConfig(peak_flops=0)
    with caplog.at_level(logging.WARNING, logger="torchtelemetry.report._flops"):
        telemetry = tt.Telemetry({}, [], flops_per_sample=1e12)
    names = {d.name for d in telemetry.descriptors}
    telemetry.close()
    assert "train/tflops_per_second" in names and "train/mfu" not in names
    assert "no peak FLOP/s known for device 'cpu'" in caplog.text and "peak_flops" in caplog.text


def _warned_of_no_peak(rank: int, world_size: int) -> bool:
    """Whether this rank's Telemetry warned that no peak FLOP/s is known (CPU: none is)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("torchtelemetry.report._flops")
    logger.addHandler(handler)
    try:
        tt.Telemetry({}, [], flops_per_token=1e9).close()
    finally:
        logger.removeHandler(handler)
    return any("no peak FLOP/s known" in record.getMessage() for record in records)


@pytest.mark.timeout(180)
def test_the_missing_peak_is_said_once_by_the_exporting_rank_not_by_every_rank() -> None:
    assert run_ranks(_warned_of_no_peak, 2) == [True, False]


def test_flops_per_sample_divides_samples_by_the_window() -> None:
    telemetry = tt.Telemetry({}, [], every=2, flops_per_sample=2e12, peak_flops=4e12)
    for step in range(2):
        time.sleep(0.005)
        telemetry.step(step, samples=8, tokens=1_000_000)
    telemetry.close()
    sps = telemetry.latest["train/samples_per_second"]
    assert telemetry.latest["train/tflops_per_second"] == pytest.approx(2e12 * sps / 1e12, rel=1e-12)
    assert telemetry.latest["train/mfu"] == pytest.approx(100 * 2e12 * sps / 4e12, rel=1e-12)


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI300X", 1300e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_table_matches_device_names(device_name: str, peak: float | None) -> None:
    assert peak_flops_of(device_name) == peak
    assert peak is None or peak in PEAK_FLOPS.values()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's statistics need a GPU")
def test_cuda_allocator_memory_detail_once_per_window() -> None:
    device = torch.device("cuda")
    metric = tt.WeightedMeanMetric().to(device)
    telemetry = tt.Telemetry({"x": metric}, [], every=2)
    names = {d.name for d in telemetry.descriptors}
    assert {"train/memory/max_active", "train/memory/max_reserved"} <= names
    assert {"train/memory/alloc_retries", "train/memory/ooms"} <= names
    block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    for step in range(2):
        metric.update(torch.ones((), device=device), 1)
        telemetry.step(step)
    telemetry.close()
    stats = torch.cuda.memory_stats(device)
    assert telemetry.latest["train/memory/max_active"] >= block.numel()
    # read before the window's own small kernels, which may reserve one more segment
    assert block.numel() <= telemetry.latest["train/memory/max_reserved"] <= stats["reserved_bytes.all.peak"]
    assert telemetry.latest["train/memory/alloc_retries"] == stats["num_alloc_retries"]
    assert telemetry.latest["train/memory/ooms"] == stats["num_ooms"]
    assert block.numel() <= telemetry.latest["train/peak_memory"] <= stats["allocated_bytes.all.peak"]


@pytest.mark.parametrize(
    ("keyword", "bad"),
    [
        ("tokens", -100),
        ("tokens", float("nan")),
        ("tokens", torch.tensor([10.0, -20.0])),
        ("tokens", torch.tensor(float("nan"))),
        ("samples", float("-inf")),
        ("samples", torch.tensor(-1)),
    ],
    ids=["negative int", "NaN float", "negative in a tensor", "NaN tensor", "-inf", "negative int tensor"],
)
def test_built_in_counters_refuse_what_a_counter_cannot_count(tmp_path: Path, keyword: str, bad: Any) -> None:
    path = tmp_path / "metrics.jsonl"
    name = f"train/{keyword}"
    with tt.Telemetry({"loss": tt.SumMetric()}, [tt.JsonlExporter(path)], every=2) as telemetry:
        telemetry.step(0, **{keyword: 20})
        refused = rf"{name}: step\({keyword}=.*\) is not a count.*nothing of this"
        with pytest.raises(ValueError, match=refused):
            telemetry.step(1, **{keyword: bad})
        telemetry.step(1, **{keyword: torch.tensor(30)})  # the step again, with a good count
        telemetry.step(2, **{keyword: 50})
    reports = _read_jsonl(path)
    assert [report["values"][name] for report in reports] == [50.0, 100.0], "nothing lost, nothing bad added"
    assert all(report["values"][f"{name}_per_second"] > 0 for report in reports)
    assert [report["step"] for report in reports] == [1, 2]
