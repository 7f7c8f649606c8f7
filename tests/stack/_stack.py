"""The stack's files as data, and the Prometheus names and labels the library emits.

Names are computed from descriptors with the library's own naming rules
(`prometheus_name`, `prometheus_label_name`), never listed by hand.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from torchtelemetry.demo import build_metrics
from torchtelemetry.export import HEALTH_DESCRIPTORS, MetricDescriptor
from torchtelemetry.export._prometheus import RUN_LABEL
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import LAST_UPDATE_METRIC, STEP_METRIC, prometheus_label_name, prometheus_name

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_DIR = ROOT / "exporters" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
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


@cache
def training_descriptors() -> tuple[MetricDescriptor, ...]:
    """What `Telemetry` exports for the demo's metrics plus its built-in signals, in both step-time
    shapes: one series per rank, and min/median/max above `max_rank_series` ranks."""
    from torchtelemetry.telemetry import Telemetry

    found: dict[str, MetricDescriptor] = {}
    for max_rank_series in (64, 0):
        telemetry = Telemetry(demo_metrics(), exporters=[], run_id="names", max_rank_series=max_rank_series)
        try:
            found.update((d.name, d) for d in telemetry.descriptors)
        finally:
            telemetry.close()
    return tuple(found.values())


def health_descriptors() -> tuple[MetricDescriptor, ...]:
    """The export hub's own health metrics."""
    return tuple(HEALTH_DESCRIPTORS)


def exporter_descriptors() -> tuple[MetricDescriptor, ...]:
    """What the Prometheus and Pushgateway exporters add to every report."""
    return (STEP_METRIC, LAST_UPDATE_METRIC)


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
    labels = {RUN_LABEL, "le", *TARGET_LABELS}
    labels.update(prometheus_label_name(d.label_name) for d in all_descriptors() if d.label_name)
    return frozenset(labels)


def queried_metrics(expr: str) -> set[str]:
    """Names in a PromQL expression that belong to the library's namespace (strings stripped)."""
    from torchtelemetry.report import NAMESPACE

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
    """Every panel, including those nested in rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace dashboard variables as Grafana does for a single value (`$name` and `${name}`)."""
    return _VARIABLE.sub(lambda m: values[next(group for group in m.groups() if group)], expr)
