"""Values per rank on real gloo ranks: one rank's NaN or Inf stays in its own slot and is exported as
such, a window exports something for every rank (or every statistic over ranks), and a per-rank
counter counts each rank's total across windows and restarts (issue 30.3, issue 32.2)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.servers import http_get

prometheus_parser = pytest.importorskip("prometheus_client.parser")

NAN, INF = float("nan"), float("inf")
# What each rank feeds `train/grad_norm` in each window (None: nothing).
FED: list[dict[int, float | None]] = [{0: 5.0, 1: NAN}, {0: 4.0, 1: INF}, {0: None, 1: None}]


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http_get(url).decode()
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k == "rank"))): sample.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for sample in family.samples
        if "grad_norm" in sample.name
    }


def _feed_nan_on_rank_1(rank: int, world_size: int, max_rank_series: int) -> list[dict[str, Any]]:
    prometheus = tt.PrometheusExporter(port=0, linger_s=0)
    metrics = {"train": {"grad_norm": tt.PerRankMetric(world_size, rank)}}
    telemetry = tt.Telemetry(
        metrics,
        [prometheus],
        every=1,
        run_id="nan-rank",
        max_rank_series=max_rank_series,
        nonfinite=["train/grad_norm"],
    )
    windows = []
    for step, fed in enumerate(FED):
        if fed[rank] is not None:
            metrics["train"]["grad_norm"].update(torch.tensor(fed[rank]))
        telemetry.step(step)
        telemetry.flush()
        scraped = _scrape(prometheus.url) if rank == 0 and prometheus.url else {}
        windows.append({"latest": dict(telemetry.latest), "scraped": scraped})
        dist.barrier()
    telemetry.close()
    return windows


def _same(value: float, expected: float) -> bool:
    return (math.isnan(expected) and math.isnan(value)) or value == expected


@pytest.mark.timeout(180)
def test_one_ranks_nan_stays_in_its_slot_and_is_exported_with_every_other_ranks_value() -> None:
    windows = run_ranks(_feed_nan_on_rank_1, 2, 64)[0]
    for window, fed in zip(windows, FED, strict=True):
        exported = window["latest"]["train/grad_norm"]
        expected = {str(rank): NAN if value is None else value for rank, value in fed.items()}
        assert exported.keys() == expected.keys()
        assert all(_same(exported[rank], expected[rank]) for rank in expected), (exported, expected)
        scraped = {labels[0][1]: value for (_, labels), value in window["scraped"].items() if labels}
        assert scraped.keys() == expected.keys()  # a real scrape serves the NaN and the Inf
        assert all(_same(scraped[rank], expected[rank]) for rank in expected), (scraped, expected)
    # The sentinel counts the NaN and the Inf, and names the rank that fed the first one.
    assert windows[-1]["latest"]["train/nonfinite/count"] == {"train/grad_norm": 2.0}
    assert windows[-1]["latest"]["train/nonfinite/first_rank"] == {"train/grad_norm": 1.0}


@pytest.mark.timeout(180)
def test_above_the_rank_series_limit_every_window_exports_min_median_max() -> None:
    windows = run_ranks(_feed_nan_on_rank_1, 2, 0)[0]
    expected = [(5.0, 5.0, 5.0), (4.0, INF, INF), (NAN, NAN, NAN)]  # NaN ranks left out; Inf ordered
    for window, (low, middle, high) in zip(windows, expected, strict=True):
        latest = window["latest"]
        assert "train/grad_norm" not in latest
        got = (latest["train/grad_norm/min"], latest["train/grad_norm/median"], latest["train/grad_norm/max"])
        assert all(_same(value, want) for value, want in zip(got, (low, middle, high), strict=True)), got
        scraped = {name: value for (name, labels), value in window["scraped"].items() if not labels}
        # the scrape carries this window's statistics, never the previous window's
        assert sorted(scraped) == [
            f"torchtelemetry_train_grad_norm_{stat}" for stat in ("max", "median", "min")
        ]
        assert _same(scraped["torchtelemetry_train_grad_norm_max"], high)


def test_a_nan_or_inf_fed_on_one_rank_never_reaches_another_ranks_slot() -> None:
    metric = tt.PerRankMetric(3, 1)
    metric.update(torch.tensor([NAN, 1.0]))
    metric.update_total(INF, 1.0)
    assert metric.sums.local[0].item() == 0.0 and metric.sums.local[2].item() == 0.0
    assert math.isnan(metric.sums.local[1].item())


UPDATES, VALUE, EVERY = 10, 100.0, 5


def _count_per_rank(rank: int, world_size: int) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtelemetry").addHandler(handler)

    def run(max_rank_series: int, steps: range, state: dict[str, Any] | None) -> tuple[Any, dict[str, Any]]:
        metrics = {"tokens": tt.PerRankMetric(world_size, rank, kind="counter")}
        telemetry = tt.Telemetry(
            metrics, every=EVERY, run_id="per-rank-counter", max_rank_series=max_rank_series, signals=False
        )
        if state is not None:
            telemetry.load_state_dict(state)
        for step in steps:
            metrics["tokens"].update(VALUE * (rank + 1))
            telemetry.step(step)
        saved = telemetry.state_dict()
        telemetry.close()
        return telemetry.latest["tokens"], saved

    first, state = run(64, range(UPDATES), None)
    resumed, state = run(64, range(UPDATES, 2 * UPDATES), state)
    above, state = run(0, range(2 * UPDATES, 3 * UPDATES), state)  # crossing max_rank_series up
    warned_before = len(records)
    below, _ = run(64, range(3 * UPDATES, 4 * UPDATES), state)  # and down
    try:
        tt.PerRankMetric(world_size, rank, kind="counter").update(-1.0)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "first": first,
        "resumed": resumed,
        "above": above,
        "below": below,
        "warned_up": records[:warned_before],
        "warned_down": records[warned_before:],
        "refused": refused,
    }


@pytest.mark.timeout(180)
def test_a_per_rank_counter_counts_each_ranks_total_across_windows_and_restarts() -> None:
    result = run_ranks(_count_per_rank, 2)[0]
    per_window = {str(rank): UPDATES * VALUE * (rank + 1) for rank in range(2)}  # 1000 and 2000
    assert result["first"] == per_window
    assert result["resumed"] == {rank: 2 * total for rank, total in per_window.items()}
    # Above the limit, the total over ranks continues from the per-rank totals: nothing restarts.
    assert result["above"] == 3 * sum(per_window.values())
    assert not [message for message in result["warned_up"] if "tokens" in message]
    # Back below, a total over ranks cannot be split per rank: each rank restarts, loudly.
    assert result["below"] == per_window
    assert any(
        "tokens" in message and "cannot be split per rank" in message for message in result["warned_down"]
    )
    assert "PerRankMetric: a counter cannot decrease" in result["refused"]
