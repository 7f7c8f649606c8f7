"""The signal registry (exporters/signals.json): generated from the code, and what the wire carries.

The shipped file must be what `torchtelemetry signals` writes today. Then a real 2-rank training
(gloo, phases, data wait, tokens, samples, learning rate, model FLOPs, a watched loss) exports
through a real `PrometheusExporter` (its endpoint scraped and parsed) and a real `OTelExporter`
(pushing to an OTLP/HTTP receiver that decodes the wire), once with a series per rank and once
with the ranks as values: every name it exports besides the user's own must be in the registry,
spelt, typed and unit-ed as the registry says, on both wires.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.receivers import OtlpHttpReceiver, attributes
from tests.servers import http_get
from tests.step_inputs import step_inputs
from torchtelemetry.cli import main
from torchtelemetry.export import (
    HEALTH_DESCRIPTORS,
    OTEL_SCHEMA_URL,
    SIGNAL_REGISTRY_SCHEMA_VERSION,
    STEP_METRIC,
)
from torchtelemetry.report import signal_descriptors

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

REGISTRY = Path(__file__).resolve().parents[2] / "exporters" / "signals.json"
USER_METRICS = {"train/loss"}
"""The run's own tree: not the registry's."""
STEPS, EVERY = 8, 2


def _registry() -> dict[str, Any]:
    return json.loads(REGISTRY.read_text(encoding="utf-8"))


def test_the_shipped_registry_is_what_torchtelemetry_signals_writes(tmp_path: Path, capsys) -> None:
    written = tmp_path / "signals.json"
    assert main(["signals", "--output", str(written)]) == 0
    assert REGISTRY.read_text(encoding="utf-8") == written.read_text(encoding="utf-8"), (
        "exporters/signals.json is stale: run `torchtelemetry signals --output exporters/signals.json`"
    )
    assert main(["signals"]) == 0
    assert capsys.readouterr().out == written.read_text(encoding="utf-8")


def test_python_m_torchtelemetry_is_the_console_script(tmp_path: Path) -> None:
    written = tmp_path / "signals.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REGISTRY.parents[2] / "src"), *sys.path])}
    command = [sys.executable, "-m", "torchtelemetry", "signals", "--output", str(written)]
    subprocess.run(command, check=True, env=env, timeout=120)
    assert written.read_text(encoding="utf-8") == REGISTRY.read_text(encoding="utf-8")


def test_the_registry_has_every_default_name_once_with_its_schema_versions() -> None:
    registry = _registry()
    assert registry["schema_version"] == SIGNAL_REGISTRY_SCHEMA_VERSION
    assert registry["otel_schema_url"] == OTEL_SCHEMA_URL
    names = [entry["name"] for entry in registry["signals"]]
    assert len(names) == len(set(names))
    expected = {d.name for d in signal_descriptors()} | {d.name for d in HEALTH_DESCRIPTORS}
    assert expected | {STEP_METRIC.name} <= set(names)
    for backend in ("prometheus", "otel"):
        spelt = [entry[backend]["name"] for entry in registry["signals"] if entry[backend] is not None]
        assert len(spelt) == len(set(spelt)), f"two names share one {backend} name"
    mapped = {m["name"] for entry in registry["signals"] for m in entry["maps_to"]}
    assert {"megatron.training.tokens_per_sec", "hw.gpu.utilization"} <= mapped


def _train(rank: int, world_size: int, otlp_endpoint: str, max_rank_series: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = {"train": {"loss": tt.WeightedMeanMetric()}}
    prometheus = tt.PrometheusExporter(port=0, linger_s=0)
    otel = tt.OTelExporter(endpoint=otlp_endpoint, timeout_s=10)
    telemetry = tt.Telemetry(
        metrics,
        [prometheus, otel],
        every=EVERY,
        run_id=f"registry-{max_rank_series}",
        max_rank_series=max_rank_series,
        flops_per_token=6 * 9,
        peak_flops=1e12,
    )
    for step in range(STEPS):
        with telemetry.data_wait():
            inputs = torch.randn(4, 8)
        with telemetry.phase("forward"):
            loss = model(inputs).pow(2).mean()
        with telemetry.phase("backward"):
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        metrics["train"]["loss"].update(loss.detach(), 4)
        telemetry.step(step, **step_inputs(tokens=32, samples=4, learning_rate=0.1))
        if step == 0:
            telemetry.checkpoint_saved(step)  # goodput is exported once a checkpoint is durable
    telemetry.flush()
    scraped = http_get(prometheus.url).decode() if telemetry.is_exporting else ""
    described = [(d.name, d.kind.value, d.unit, d.description) for d in telemetry.descriptors]
    telemetry.close()
    return {"scraped": scraped, "described": described}


@pytest.fixture(scope="module", params=[64, 1], ids=["series-per-rank", "ranks-as-values"])
def run(request) -> dict[str, Any]:
    with OtlpHttpReceiver() as receiver:
        (rank0, _) = run_ranks(_train, 2, receiver.metrics_endpoint, request.param, timeout_s=240)
        pushed: dict[str, Any] = {}
        for received in receiver.received:
            for resource_metrics in received.request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    pushed.update((metric.name, metric) for metric in scope_metrics.metrics)
    return {**rank0, "pushed": pushed, "max_rank_series": request.param}


def test_every_name_the_run_describes_is_in_the_registry_as_described(run: dict[str, Any]) -> None:
    by_name = {entry["name"]: entry for entry in _registry()["signals"]}
    for name, kind, unit, description in run["described"]:
        if name in USER_METRICS:
            continue
        assert name in by_name, f"{name!r} is exported by a default run and missing from the registry"
        entry = by_name[name]
        assert (entry["kind"], entry["unit"], entry["description"]) == (kind, unit, description), name


def test_the_prometheus_wire_spells_every_name_as_the_registry(run: dict[str, Any]) -> None:
    by_name = {e["prometheus"]["name"]: e for e in _registry()["signals"]}
    user = {f"torchtelemetry_{name.replace('/', '_')}" for name in USER_METRICS}
    seen = set()
    for family in prometheus_parser.text_string_to_metric_families(run["scraped"]):
        for sample in family.samples:
            if sample.name in user:
                continue
            # A histogram's samples (`_bucket`, `_sum`, `_count`) are its family's name.
            name = family.name if family.type == "histogram" else sample.name
            assert name in by_name, f"{sample.name} is on the wire and not in the registry"
            entry = by_name[name]
            assert family.type == entry["prometheus"]["type"], sample.name
            assert family.documentation == entry["description"], sample.name
            label = entry["prometheus"]["label"]
            bucket = {"le"} if sample.name.endswith("_bucket") else set()
            assert set(sample.labels) == {"run", "route"} | ({label} if label else set()) | bucket, (
                sample.name
            )
            seen.add(entry["name"])
    _assert_emitted(seen, run["max_rank_series"])


def test_the_otlp_wire_names_types_and_units_every_metric_as_the_registry(run: dict[str, Any]) -> None:
    by_name = {e["otel"]["name"]: e for e in _registry()["signals"] if e["otel"] is not None}
    user = {name.replace("/", ".") for name in USER_METRICS}
    seen = set()
    for name, metric in run["pushed"].items():
        if name in user:
            continue
        assert name in by_name, f"{name} is on the OTLP wire and not in the registry"
        otel = by_name[name]["otel"]
        data_type = metric.WhichOneof("data")
        assert (data_type, metric.unit) == (otel["type"], otel["unit"]), name
        assert metric.description == by_name[name]["description"], name
        data = getattr(metric, data_type)
        if data_type == "sum":
            assert data.is_monotonic, name
        keys = {key for point in data.data_points for key in attributes(point.attributes)}
        assert keys == ({otel["attribute"]} if otel["attribute"] else set()), name
        seen.add(by_name[name]["name"])
    _assert_emitted(seen, run["max_rank_series"])


def _assert_emitted(seen: set[str], max_rank_series: int) -> None:
    """The run emitted each family of names: the check above looked at something."""
    common = {
        "train/step",
        "train/step_time/histogram",
        "train/tokens",
        "train/tokens_per_second",
        "train/samples",
        "train/learning_rate",
        "train/tflops_per_second",
        "train/mfu",
        "train/peak_memory",
        "train/phases/share",
        "train/straggler/score",
        "train/nonfinite/count",
        "train/memory/rss/max",
        "train/goodput",
        "exporter/exported_reports",
    }
    per_rank = {"train/step_time", "train/data_wait", "train/phase/forward"}
    as_values = {"train/step_time/median", "train/data_wait/max"}
    assert common <= seen, sorted(common - seen)
    assert (per_rank if max_rank_series > 1 else as_values) <= seen
    assert not (as_values if max_rank_series > 1 else per_rank) & seen
