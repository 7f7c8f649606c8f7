"""The stack's files as data, and the Prometheus names and labels the library emits.

Names are computed from descriptors with the library's own naming rules
(`prometheus_name`, `prometheus_label_name`), never listed by hand.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("yaml")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

import yaml

from torchtelemetry.demo import build_metrics
from torchtelemetry.export import (
    HEALTH_DESCRIPTORS,
    LAST_UPDATE_METRIC,
    ROUTE_LABEL,
    RUN_FINISHED_METRIC,
    RUN_LABEL,
    STEP_METRIC,
    MetricDescriptor,
    prometheus_label_name,
    prometheus_name,
)
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import describe_metrics, signal_descriptors
from torchtelemetry.report.signals import cuda_only_descriptors, event_only_descriptors

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_DIR = ROOT / "exporters" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
PROMETHEUS_HOST_CONFIG = PROMETHEUS_DIR / "prometheus-host.yml"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERTS_TEST = PROMETHEUS_DIR / "alerts_test.yml"
COLLECTOR_CONFIG = ROOT / "exporters" / "otel-collector" / "config.yaml"
GRAFANA_PROVISIONING = ROOT / "exporters" / "grafana" / "provisioning"
DASHBOARD_DIR = ROOT / "dashboards"
STACK_DOC = ROOT / "docs" / "stack.md"

TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus itself adds to every scraped series."""

GRAFANA_GLOBAL_VARIABLES = frozenset(
    {
        "__all",
        "__rate_interval",
        "__interval",
        "__interval_ms",
        "__range",
        "__range_s",
        "__range_ms",
        "__from",
        "__to",
    }
)

_METRIC = re.compile(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))|\[\[(\w+)\]\]")


def demo_metrics() -> dict[str, Any]:
    """The metric tree of `torchtelemetry demo` (loss, accuracy, gradient-norm histogram)."""
    return build_metrics()


def other_metrics() -> dict[str, Any]:
    """A tree that shares no name with the demo's: perplexity, validation loss and worst loss,
    a counter of skipped samples, an update-norm histogram and a per-class accuracy."""
    import torchtelemetry as tt

    return {
        "train": {"ppl": tt.WeightedMeanMetric()},
        "val": {"loss": tt.WeightedMeanMetric(), "worst_loss": tt.MaxMetric()},
        "data": {"skipped": tt.SumMetric(kind="counter", unit="samples")},
        "optim": {"update_norm": tt.HistogramMetric(bins=[1e-3, 1e-2, 1e-1, 1])},
    }


TREES = {"demo": demo_metrics, "other": other_metrics}
"""Metric trees the dashboards are tested with: each must get data in every discovered panel."""


def feed(tree: str, metrics: dict[str, Any], generator: Any) -> None:
    """One training step's updates of every metric of `TREES[tree]`."""
    import torch

    if tree == "demo":
        logits = torch.randn(8, 4, generator=generator)
        target = torch.randint(0, 4, (8,), generator=generator)
        metrics["train"]["loss"].update(1.0 + torch.rand((), generator=generator), 8)
        metrics["train"]["accuracy"].update(logits, target)
        metrics["train"]["grad_norm"].update(4 * torch.rand(3, generator=generator))
    else:
        metrics["train"]["ppl"].update(20 + torch.rand((), generator=generator), 8)
        metrics["val"]["loss"].update(2 + torch.rand((), generator=generator), 1)
        metrics["val"]["worst_loss"].update(3 + torch.rand(4, generator=generator))
        metrics["data"]["skipped"].update(torch.tensor(2.0))
        metrics["optim"]["update_norm"].update(torch.rand(5, generator=generator))


def tree_descriptors(tree: str) -> tuple[MetricDescriptor, ...]:
    """What `Telemetry` exports for the metrics of `TREES[tree]` themselves."""
    return tuple(describe_metrics(TREES[tree]()))


@cache
def training_descriptors() -> tuple[MetricDescriptor, ...]:
    """Every training name: the built-in signals and the metrics of every tree in `TREES`."""
    found = {d.name: d for tree in TREES for d in tree_descriptors(tree)}
    found.update((d.name, d) for d in signal_descriptors())
    return tuple(found.values())


def cuda_only_names() -> frozenset[str]:
    """Sample names only a CUDA run emits (the allocator's detail, memory health's device
    quantities, GPU health through NVML)."""
    return frozenset(name for descriptor in cuda_only_descriptors() for name in sample_names(descriptor))


def event_only_names() -> frozenset[str]:
    """Sample names exported only once something happened (a non-finite value, a rank that
    straggles, a capture, a hang), as the signals declare them (`event_only_descriptors()`)."""
    return frozenset(name for descriptor in event_only_descriptors() for name in sample_names(descriptor))


def health_descriptors() -> tuple[MetricDescriptor, ...]:
    """The export hub's own health metrics."""
    return tuple(HEALTH_DESCRIPTORS)


def exporter_descriptors() -> tuple[MetricDescriptor, ...]:
    """What the Prometheus and Pushgateway exporters add to every report."""
    return (STEP_METRIC, LAST_UPDATE_METRIC, RUN_FINISHED_METRIC)


def sample_names(descriptor: MetricDescriptor) -> set[str]:
    """The Prometheus sample names of one descriptor (a histogram has three)."""
    name = prometheus_name(descriptor)
    if descriptor.kind is MetricKind.HISTOGRAM:
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return {name}


def all_descriptors() -> tuple[MetricDescriptor, ...]:
    return (*training_descriptors(), *health_descriptors(), *exporter_descriptors())


@cache
def emitted_names() -> frozenset[str]:
    """Every sample name the library puts on a Prometheus scrape or push."""
    return frozenset(name for descriptor in all_descriptors() for name in sample_names(descriptor))


@cache
def emitted_labels() -> frozenset[str]:
    """Every label a series of the library can carry, once Prometheus has scraped it."""
    labels = {RUN_LABEL, ROUTE_LABEL, "le", *TARGET_LABELS}
    labels.update(prometheus_label_name(d.label_name) for d in all_descriptors() if d.label_name)
    return frozenset(labels)


def queried_metrics(expr: str) -> set[str]:
    """Names in a PromQL expression that belong to the library's namespace (strings stripped)."""
    from torchtelemetry.export import NAMESPACE

    return {token for token in _METRIC.findall(_STRING.sub('""', expr)) if token.startswith(f"{NAMESPACE}_")}


def queried_labels(expr: str) -> set[str]:
    """Label names used in matchers and in by/without/on/ignoring/group_* clauses."""
    labels = set(_MATCHER_LABEL.findall(expr))
    for group in _GROUPING.findall(_STRING.sub('""', expr)):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    return labels


def variables_used(text: str) -> set[str]:
    """`$name`, `${name}`, `${name:format}` and `[[name]]` references in a string."""
    return {next(group for group in match if group) for match in _VARIABLE.findall(text)}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboards() -> dict[Path, dict[str, Any]]:
    """Every dashboard JSON file, parsed."""
    return {path: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data, including those nested in collapsed rows (not the rows)."""
    for panel in dashboard.get("panels", []):
        if panel["type"] != "row":
            yield panel
        yield from panel.get("panels", [])


def rows(dashboard: dict[str, Any]) -> list[str]:
    """The titles of a dashboard's rows."""
    return [panel["title"] for panel in dashboard.get("panels", []) if panel["type"] == "row"]


def rules() -> list[dict[str, Any]]:
    """Every rule of alerts.yml: alerts and the recording rules they read."""
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def alert_rules() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def recording_rules() -> dict[str, str]:
    """Recorded name -> expression."""
    return {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}


RECORDED_LABELS = frozenset({"metric"})
"""Labels the recording rules add (`torchtelemetry:loss_sum_5m` names each loss by `metric`)."""


def substitute(expr: str, values: dict[str, str], *, keep_others: bool = False) -> str:
    """Replace dashboard variables as Grafana does for a single value (`$name` and `${name}`);
    with `keep_others`, variables missing from `values` stay as they are."""

    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return values.get(name, match.group(0)) if keep_others else values[name]

    return _VARIABLE.sub(value, expr)


DISCOVERY_VARIABLES = ("gauge", "counter", "histogram")
"""Template variables that list the run's own metrics of the kind they are named after; a panel
repeated over one is a discovered panel."""


def own_names(tree: str, unplaced: Sequence[MetricDescriptor] = ()) -> dict[str, set[str]]:
    """What each discovery variable must list for a run of `TREES[tree]`: the tree's own metrics and
    the `unplaced` built-in signals (no fixed panel shows them)."""
    descriptors = (*tree_descriptors(tree), *unplaced)
    return {
        variable: {prometheus_name(d) for d in descriptors if d.kind is MetricKind(variable)}
        for variable in DISCOVERY_VARIABLES
    }


def dashboard_generator() -> Any:
    """dashboards/generate.py as a module (dashboards/ is not a package)."""
    spec = importlib.util.spec_from_file_location("generate_dashboards", DASHBOARD_DIR / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unplaced_descriptors() -> list[MetricDescriptor]:
    """The built-in signals no fixed panel shows (`unplaced_names()` of dashboards/generate.py: a
    panel of its own is optional): the discovery variables list them like the run's own metrics."""
    unplaced = dashboard_generator().unplaced_names()
    return [d for d in signal_descriptors() if sample_names(d) & unplaced]


def generated_training_dashboard() -> str:
    """What dashboards/generate.py writes to dashboards/training.json."""
    return dashboard_generator().render()


def discovery_query(variable: dict[str, Any]) -> tuple[str, re.Pattern[str]]:
    """(series selector, Grafana regex as a Python pattern) of a `label_values(selector, __name__)`
    variable; the regex's first group, if any, is the value (as in Grafana)."""
    definition = variable["definition"]
    assert definition.startswith("label_values(") and definition.endswith(", __name__)"), definition
    regex = variable["regex"]
    assert regex.startswith("/") and regex.endswith("/"), regex
    return definition[len("label_values(") : -len(", __name__)")], re.compile(regex[1:-1])


def discovered(variable: dict[str, Any], names: set[str] | frozenset[str]) -> set[str]:
    """The values a discovery variable lists when Prometheus holds series named `names`."""
    selector, pattern = discovery_query(variable)
    (name_regex,) = re.findall(r'__name__=~"([^"]*)"', selector)
    values = set()
    for name in names:
        match = pattern.fullmatch(name) if re.fullmatch(name_regex, name) else None
        if match:
            values.add(match.group(1) if pattern.groups else name)
    return values
