"""The cardinality budget (docs/scale.md): the series a run exports grow with its metrics, not its ranks.

Rank 0 of a simulated world of 8, 1,024 and 16,384 ranks publishes two windows of a tree with a
value per rank of its own (a gauge and a counter), besides the built-in signals and the health
signals (two phases and the data wait with their straggler scores, the non-finite sentinel and
spike scores of the two losses, memory health, goodput). The world is
simulated where the reports see it: the built-in signals and `PerRankMetric`s are built for that
world size and hold every rank's slot, as after the window's all-reduce. The reports go through
the real `ExportHub` to a real `PrometheusExporter` (its endpoint scraped over HTTP and parsed) and
a real `OTelExporter` (pushing to an OTLP/HTTP receiver that decodes the wire), and the series
counted are those on the wire.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.receivers import OtlpHttpReceiver, metrics_by_name
from tests.servers import http_get
from torchtelemetry.export import ExportHub, OTelExporter, PrometheusExporter, RunInfo
from torchtelemetry.metric import metric_leaves
from torchtelemetry.report import (
    ModelFlops,
    RankSeriesLimit,
    SignalContext,
    SignalSet,
    WindowPublisher,
    builtin_signals,
    describe_with_signals,
    to_python,
)
from torchtelemetry.report.signals import STEP_TIME_BOUNDS, DataWait, MemoryHealth, Phases, StepTime
from torchtelemetry.run import GoodputLedger

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

WORLDS = (8, 1024, 16384)
MAX_RANK_SERIES = 64  # TelemetryConfig's default
BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)

# The tree below, as docs/scale.md's formula counts it.
SCALARS = 3 + 8
"""loss, accuracy, the skipped-samples counter; tokens, samples, their rates, learning rate, peak
memory, TFLOP/s and MFU (the built-in signals' scalars with model FLOPs on)."""
HISTOGRAM_BOUNDS = (len(BOUNDS), len(STEP_TIME_BOUNDS))
"""grad_norm's, and the built-in step-time histogram's."""
GAUGES_PER_RANK = 3 + 1
"""step time, data wait, data-wait share; the tree's own loss per rank."""
COUNTERS_PER_RANK = 1
"""the tree's own tokens per rank."""
HEALTH_PER_EXPORTER = 4
EXPORTERS = 2
PHASES = ("forward", "optimizer")
"""Not "backward": the phase that holds the gradient collective has no straggler values in a run
that does not measure its wait (docs/scale.md)."""
TOP_K = 3
WATCHED = 2
"""train/loss and ranks/loss: the health sentinel watches every metric whose name ends in loss."""


def health_series(world_size: int) -> int:
    """The health signals' share of docs/scale.md's formula (on CPU, nothing non-finite seen)."""
    phased = len(PHASES) + 1  # and the data wait
    per_rank = len(PHASES) * world_size if world_size <= MAX_RANK_SERIES else 0
    # min, median, max, min_rank, median_rank, max_rank, share, four straggler scores and the
    # straggler cost per phase (no threshold before a run's 4th window, no straggler named); a
    # non-finite and a spike counter per watched metric; RSS and its rank; goodput, productive and
    # wall time, restarts and recomputed steps
    return per_rank + 12 * phased + 2 * WATCHED + 2 + 5


def budget(world_size: int, backend: str) -> int:
    """docs/scale.md's formula: what a run of `world_size` ranks exports of this tree."""
    if world_size <= MAX_RANK_SERIES:
        per_rank = (GAUGES_PER_RANK + COUNTERS_PER_RANK) * world_size + 2  # + step time's extreme ranks
    else:
        per_rank = 3 * GAUGES_PER_RANK + COUNTERS_PER_RANK + 2
    health = HEALTH_PER_EXPORTER * EXPORTERS + health_series(world_size)
    if backend == "prometheus":  # step and last update; a histogram: its buckets, +Inf, sum and count
        return 2 + health + SCALARS + sum(b + 3 for b in HISTOGRAM_BOUNDS) + per_rank
    return 1 + health + SCALARS + len(HISTOGRAM_BOUNDS) + per_rank  # OTLP: the step; a histogram is a point


def _tree(world_size: int) -> dict[str, Any]:
    return {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "accuracy": tt.AccuracyMetric(),
            "grad_norm": tt.HistogramMetric(bins=list(BOUNDS)),
        },
        "data": {"skipped": tt.SumMetric(kind="counter", unit="samples")},
        "ranks": {
            "loss": tt.PerRankMetric(world_size, 0, description="Loss per rank"),
            "tokens": tt.PerRankMetric(world_size, 0, kind="counter", unit="tokens"),
        },
    }


def _per_rank(world_size: int, window: int) -> torch.Tensor:
    """Every rank's value in a window: distinct, largest on the last rank, smallest on rank 1."""
    values = 1.0 + torch.arange(world_size, dtype=torch.float64) / world_size + window
    values[1] = 0.5
    return values


def _fill(
    tree: dict[str, Any], signals: SignalSet, goodput: GoodputLedger, world_size: int, window: int
) -> None:
    """One window's updates, with every rank's slot of the values per rank filled (as reduced)."""
    tree["train"]["loss"].update(torch.tensor(2.0), 8)
    tree["train"]["accuracy"].update(torch.randn(8, 4), torch.randint(0, 4, (8,)))
    tree["train"]["grad_norm"].update(torch.tensor([0.3, 4.0]))
    tree["data"]["skipped"].update(torch.tensor(1.0))
    inputs = {"tokens": 1024, "samples": 8, "learning_rate": 1e-3, "data_time": 0.01}
    signals.record_step(10 * window, None if window == 0 else 0.1, inputs)
    goodput.checkpoint_saved(10 * window)  # goodput is exported once a checkpoint is durable
    signals.flush(1.0)
    by_type = {type(signal): signal for signal in signals.signals}
    step_time, data_wait = by_type[StepTime], by_type[DataWait]
    phases, memory = by_type[Phases], by_type[MemoryHealth]
    ones = torch.ones(world_size, dtype=torch.float64)
    for metric in (tree["ranks"]["loss"], tree["ranks"]["tokens"], step_time.metric, data_wait.wait):
        metric.sums.update(_per_rank(world_size, window))
        metric.counts.update(ones)
    data_wait.share.sums.update(ones)
    data_wait.share.counts.update(ones)
    phases.times.seconds.local.copy_(torch.stack([_per_rank(world_size, window)] * len(PHASES)) / 10)
    phases.times.steps.local.copy_(ones)
    memory.ranks.values.local.copy_(_per_rank(world_size, window).unsqueeze(0) * 2**30)


@dataclass
class Exported:
    """What rank 0 of one simulated world put on the wire, after two windows."""

    prometheus: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    """Every sample of the scrape: (name, labels) -> value."""
    otlp_points: dict[str, list[Any]]
    """Every OTLP metric of the last push: name -> its data points."""


def _export(world_size: int, max_rank_series: int = MAX_RANK_SERIES) -> Exported:
    tree = _tree(world_size)
    context = SignalContext(world_size, 0, torch.device("cpu"), max_rank_series)
    goodput = GoodputLedger(None)
    signals = SignalSet(
        builtin_signals(
            context,
            leaves=metric_leaves(tree, op="test"),
            flops=ModelFlops(per_unit=6e6, per_sample=False, peak=1e12),
            phases=PHASES,
            straggler_top_k=TOP_K,
            goodput=goodput,
        )
    )
    leaves = metric_leaves(tree, op="test") + list(signals.metrics().items())
    ranks = RankSeriesLimit(world_size, max_rank_series)
    descriptors = describe_with_signals(tree, signals, ranks)
    prometheus = PrometheusExporter(port=0, linger_s=0)
    with OtlpHttpReceiver() as receiver:
        hub = ExportHub(
            [prometheus, OTelExporter(endpoint=receiver.metrics_endpoint, timeout_s=10)],
            run=RunInfo.create(f"budget-{world_size}", world_size=world_size),
        )
        try:
            hub.describe(descriptors)
            publisher = WindowPublisher(leaves, descriptors, signals, hub.submit, ranks)
            for window in range(2):  # the second report carries every exporter's health
                _fill(tree, signals, goodput, world_size, window)
                in_flight = publisher.scheduled(
                    10 * (window + 1), duration_s=1.0, steps=1, host=signals.host_values()
                )
                publisher.release()  # nothing logged at its step: submit it as soon as it is built
                publisher.publish(in_flight, [to_python(metric.compute()) for _, metric in leaves])
                for _, metric in leaves:
                    metric.reset()
                assert hub.force_flush(30)
            assert prometheus.url is not None
            text = http_get(prometheus.url).decode()
            (request, *_) = receiver.received[-1:]
        finally:
            hub.close(10)
            signals.close()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for sample in family.samples
    }
    points = {}
    for name, metric in metrics_by_name(request.request).items():
        data = getattr(metric, metric.WhichOneof("data"))
        points[name] = list(data.data_points)
    return Exported(samples, points)


@pytest.fixture(scope="module")
def exported() -> Iterator[dict[int, Exported]]:
    yield {world_size: _export(world_size) for world_size in WORLDS}


@pytest.mark.parametrize("world_size", WORLDS)
def test_the_series_a_run_exports_follow_the_budget(exported: dict[int, Exported], world_size: int) -> None:
    wire = exported[world_size]
    assert len(wire.prometheus) == budget(world_size, "prometheus")
    assert sum(len(points) for points in wire.otlp_points.values()) == budget(world_size, "otlp")
    # Bounded whatever the world size: at most max_rank_series series per value per rank.
    per_rank_values = GAUGES_PER_RANK + COUNTERS_PER_RANK + len(PHASES)
    assert len(wire.prometheus) <= budget(1, "prometheus") + per_rank_values * (MAX_RANK_SERIES - 1)


def test_above_the_limit_the_series_do_not_grow_with_ranks(exported: dict[int, Exported]) -> None:
    wide, wider = exported[1024], exported[16384]
    assert {key[0] for key in wide.prometheus} == {key[0] for key in wider.prometheus}
    assert len(wide.prometheus) == len(wider.prometheus)
    assert {name: len(p) for name, p in wide.otlp_points.items()} == {
        name: len(p) for name, p in wider.otlp_points.items()
    }
    labels = {label for _, labels in wider.prometheus for label, _ in labels}
    assert "rank" not in labels
    for points in wider.otlp_points.values():
        for point in points:
            assert all(attribute.key != "rank" for attribute in point.attributes)


def test_ranks_travel_as_values_and_statistics_are_exact(exported: dict[int, Exported]) -> None:
    world_size = 16384
    samples = {name: value for (name, _), value in exported[world_size].prometheus.items()}
    expected = _per_rank(world_size, 1)
    for prefix in ("torchtelemetry_ranks_loss", "torchtelemetry_train_step_time_seconds"):
        stem = prefix.removesuffix("_seconds")
        unit = "_seconds" if prefix.endswith("_seconds") else ""
        assert samples[f"{stem}_min{unit}"] == 0.5
        assert samples[f"{stem}_max{unit}"] == expected.max().item()
        assert samples[f"{stem}_median{unit}"] == statistics.median(expected.tolist())
    assert samples["torchtelemetry_train_step_time_min_rank"] == 1
    assert samples["torchtelemetry_train_step_time_max_rank"] == world_size - 1
    # The health signals too: the slowest rank in a phase, the rank with the most memory.
    by_phase = {
        (name, dict(labels).get("phase")): value
        for (name, labels), value in exported[world_size].prometheus.items()
    }
    assert by_phase[("torchtelemetry_train_straggler_rank", "forward")] == world_size - 1
    assert by_phase[("torchtelemetry_train_phases_min_rank", "forward")] == 1
    assert by_phase[("torchtelemetry_train_phases_max_seconds", "forward")] == expected.max().item() / 10
    assert samples["torchtelemetry_train_memory_rss_max_rank"] == world_size - 1
    # A counter per rank becomes its total over ranks (both windows: a running total).
    total = math.fsum(_per_rank(world_size, 0).tolist()) + math.fsum(expected.tolist())
    assert samples["torchtelemetry_ranks_tokens_total"] == pytest.approx(total, rel=1e-12)


def test_below_the_limit_each_rank_is_a_series(exported: dict[int, Exported]) -> None:
    samples = exported[8].prometheus
    ranks = sorted(
        int(dict(labels)["rank"]) for name, labels in samples if name == "torchtelemetry_ranks_loss"
    )
    assert ranks == list(range(8))
    assert len(exported[8].otlp_points["ranks.loss"]) == 8


def test_max_rank_series_zero_keeps_even_eight_ranks_to_statistics() -> None:
    wire = _export(8, max_rank_series=0)
    assert all("rank" not in dict(labels) for _, labels in wire.prometheus)
    assert len(wire.prometheus) == budget(1024, "prometheus")
