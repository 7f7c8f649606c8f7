"""The reports both Prometheus routes are tested with: a 2-rank gloo run whose exported values are
read back from a real Prometheus (scrape endpoint and Pushgateway), and one report in this process."""

from __future__ import annotations

import threading
from typing import Any

from tests.servers import wait_for
from torchtelemetry import (
    HistogramMetric,
    PerRankMetric,
    PrometheusExporter,
    PushgatewayExporter,
    SumMetric,
    WeightedMeanMetric,
    sync_metrics,
)
from torchtelemetry.export import ExportHub, HistogramValue, MetricDescriptor, NullHub, RunInfo
from torchtelemetry.metric import MetricKind, metric_leaves
from torchtelemetry.report import describe_metrics, flatten_results, to_python

STEPS = 3
BINS = [0.5, 1.0, 2.0, 4.0]
WORLD_SIZE = 2


# The training run: rank-dependent data, synced, exported from rank 0.


def rank_data(rank: int, step: int) -> dict[str, Any]:
    """What `rank` observes at `step`: exactly representable numbers, so global values are exact."""
    return {
        "loss": ([float(rank + step), 2.0 * (rank + step)], [1.0, 3.0]),
        "tokens": 100.0 * (rank + 1) * step,
        "grad_norm": [0.25, 0.75, 1.5, 1.5 + rank, 3.0 * (rank + 1)],
        "step_time": 0.25 * (rank + 1) * step,
    }


def build_metrics(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "train": {
            "loss": WeightedMeanMetric(description="Training loss, weighted by tokens"),
            "tokens": SumMetric(kind="counter", unit="tokens", description="Tokens seen"),
        },
        "grad_norm": HistogramMetric(bins=BINS, description="Gradient norm"),
        "step_time": PerRankMetric(world_size, rank, unit="seconds", description="Step time per rank"),
    }


def expected_values(world_size: int, step: int) -> dict[str, Any]:
    """Global values after `step` steps, computed here in plain Python."""
    data = [rank_data(rank, s) for rank in range(world_size) for s in range(1, step + 1)]
    weighted = sum(v * w for d in data for v, w in zip(*d["loss"], strict=True))
    grad = [g for d in data for g in d["grad_norm"]]
    counts = [sum(1 for g in grad if (i == 0 or g > BINS[i - 1]) and g <= b) for i, b in enumerate(BINS)]
    counts.append(sum(1 for g in grad if g > BINS[-1]))
    return {
        "loss": weighted / sum(w for d in data for w in d["loss"][1]),
        "tokens": sum(d["tokens"] for d in data),
        "step_time": {
            str(rank): sum(rank_data(rank, s)["step_time"] for s in range(1, step + 1)) / step
            for rank in range(world_size)
        },
        "grad_count": float(len(grad)),
        "grad_sum": sum(grad),
        "grad_median": prometheus_quantile(0.5, BINS, counts),
    }


def prometheus_quantile(q: float, bounds: list[float], counts: list[int]) -> float:
    """What `histogram_quantile` computes: linear interpolation inside the bucket holding rank q*n."""
    cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
    rank = q * cumulative[-1]
    bucket = next(i for i, c in enumerate(cumulative) if c >= rank)
    if bucket == len(bounds):
        return bounds[-1]
    lower, below = (0.0, 0) if bucket == 0 else (bounds[bucket - 1], cumulative[bucket - 1])
    return lower + (bounds[bucket] - lower) * (rank - below) / (cumulative[bucket] - below)


def observe(prometheus_url: str, selector: str, step: int) -> dict[str, Any]:
    """Wait until Prometheus has scraped `step`, then read every exported value back."""

    def one(expr: str) -> float:
        (sample,) = wait_for(prometheus_url, expr)
        return sample.value

    wait_for(prometheus_url, f"torchtelemetry_train_step{{{selector}}} == {step}", timeout_s=90)
    series = wait_for(prometheus_url, f'{{__name__=~"torchtelemetry_.+",{selector}}}')
    return {
        "step": one(f"torchtelemetry_train_step{{{selector}}}"),
        "loss": one(f"torchtelemetry_train_loss{{{selector}}}"),
        "tokens": one(f"torchtelemetry_train_tokens_total{{{selector}}}"),
        "step_time": {
            s.labels["rank"]: s.value
            for s in wait_for(prometheus_url, f"torchtelemetry_step_time_seconds{{{selector}}}")
        },
        "grad_count": one(f"torchtelemetry_grad_norm_count{{{selector}}}"),
        "grad_sum": one(f"torchtelemetry_grad_norm_sum{{{selector}}}"),
        "grad_median": one(
            f"histogram_quantile(0.5, sum by (le) (torchtelemetry_grad_norm_bucket{{{selector}}}))"
        ),
        "reports_total": one(
            f'torchtelemetry_exporter_exported_reports_total{{{selector},exporter="export"}}'
        ),
        "last_update": one(f"torchtelemetry_last_update_timestamp_seconds{{{selector}}}"),
        "label_names": sorted({name for s in series for name in s.labels}),
    }


def train_and_export(
    rank: int, world_size: int, backend: str, target: str, prometheus_url: str, selector: str, run_id: str
) -> Any:
    """Each rank updates and syncs; rank 0's hub exports and reads each step back from Prometheus."""
    metrics = build_metrics(rank, world_size)
    leaves = metric_leaves(metrics)
    exporter = (
        PrometheusExporter(port=int(target), name="export")
        if backend == "prometheus"
        else PushgatewayExporter(target, name="export")
    )  # the same constructor call on every rank; only rank 0's hub starts it
    run = RunInfo(run_id=run_id, world_size=world_size)
    hub = ExportHub([exporter], run=run) if rank == 0 else NullHub()
    hub.describe(describe_metrics(metrics))
    observed = []
    for step in range(1, STEPS + 1):
        data = rank_data(rank, step)
        metrics["train"]["loss"].update(*map(_tensor, data["loss"]))
        metrics["train"]["tokens"].update(_tensor(data["tokens"]))
        metrics["grad_norm"].update(_tensor(data["grad_norm"]))
        metrics["step_time"].update(_tensor(data["step_time"]))
        sync_metrics(metrics)
        hub.submit(step, flatten_results(leaves, [to_python(m.compute()) for _, m in leaves]))
        if rank == 0:
            observed.append(observe(prometheus_url, selector, step))
    hub.close(timeout_s=10)
    if rank != 0:
        return {
            "threads": [t.name for t in threading.enumerate() if t.name.startswith("torchtelemetry")],
            "served": exporter.url if isinstance(exporter, PrometheusExporter) else None,
        }
    return {"observed": observed, "health": hub.health()["export"]}


def _tensor(value: Any) -> Any:
    import torch

    return torch.tensor(value, dtype=torch.float64)


def check_observations(result: dict[str, Any]) -> None:
    observed = result["observed"]
    assert [o["step"] for o in observed] == [1.0, 2.0, 3.0]  # the step advances
    for step, seen in enumerate(observed, start=1):
        expected = expected_values(WORLD_SIZE, step)
        for key, value in expected.items():
            assert seen[key] == value, (step, key)
    last_updates = [o["last_update"] for o in observed]
    assert last_updates == sorted(last_updates)
    assert [o["reports_total"] for o in observed] == [1.0, 2.0, 3.0]  # each report counts itself
    assert "step" not in observed[-1]["label_names"]
    assert {"run", "rank", "exporter", "le"} <= set(observed[-1]["label_names"])
    assert result["health"].exported_reports == STEPS and result["health"].errors == 0


# One report in this process.


def sample_report(step: int) -> dict[str, Any]:
    return {
        "train/loss": 0.5 * step,
        "train/tokens": 1000.0 * step,
        "train/step_time": {"0": 0.25, "1": 0.5},
        "grad_norm": HistogramValue(
            bounds=(0.5, 1.0, 2.0), counts=(1.0, 2.0, 3.0, 4.0), sum=17.5, count=10.0
        ),
    }


DESCRIPTORS = [
    MetricDescriptor("train/loss", description="Training loss"),
    MetricDescriptor("train/tokens", MetricKind.COUNTER, unit="tokens", description="Tokens seen"),
    MetricDescriptor("train/step_time", unit="seconds", description="Step time per rank", label_name="rank"),
    MetricDescriptor("grad_norm", MetricKind.HISTOGRAM, description="Gradient norm"),
]
RUN = RunInfo(run_id="run-1")
