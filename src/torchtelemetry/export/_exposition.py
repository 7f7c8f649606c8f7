"""The Prometheus exposition of the reports: `PrometheusCollector`, shared by both Prometheus exporters.

`PrometheusCollector` turns the latest report into metric families (gauges,
counters with `_total`, real histograms with cumulative `le` buckets, one series
per label value, `run` and `route` labels on every series and never the step as a
label); the scrape endpoint and the Pushgateway exporter both expose it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtelemetry._optional import import_optional
from torchtelemetry.export._naming import (
    LAST_UPDATE_METRIC,
    NAMESPACE,
    RUN_FINISHED_METRIC,
    STEP_METRIC,
    merge_descriptors,
    prometheus_label_name,
    prometheus_name,
)
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import HistogramValue, MetricDescriptor, NameCollisionError, ReportValues

__all__ = [
    "ROUTES",
    "ROUTE_LABEL",
    "RUN_LABEL",
    "PrometheusCollector",
    "import_prometheus_client",
    "openmetrics_accept",
    "openmetrics_handler",
]

RUN_LABEL = "run"
"""Label carrying `RunInfo.run_id` on every series."""
ROUTE_LABEL = "route"
"""Label naming the way a series reached Prometheus, on every series: one Prometheus can hold the same
run by several routes (the scrape endpoint and the Pushgateway), and the dashboards show one at a time."""
ROUTES = ("scrape", "pushgateway", "otlp")
"""Values of `ROUTE_LABEL`: `PrometheusExporter`, `PushgatewayExporter`, and the OpenTelemetry
Collector of exporters/otel-collector (which inserts it as a resource attribute)."""


def import_prometheus_client() -> Any:
    """`prometheus_client`, or an ImportError that names the pip extra."""
    for module in ("prometheus_client.metrics_core", "prometheus_client.samples", "prometheus_client.utils"):
        import_optional(module, "prometheus", "the Prometheus exporters")
    return import_optional("prometheus_client", "prometheus", "the Prometheus exporters")


def openmetrics_accept(header: str) -> str:
    """`header` with every `application/openmetrics-text` entry asking for version 1.0.0.

    prometheus_client serves OpenMetrics 1.0.0 only for an entry naming that version (or none):
    `application/openmetrics-text; version=0.0.1`, which Prometheus before 2.31 and other scrapers
    send, got the classic text format. 0.0.1 is the draft name of the same format, so every
    OpenMetrics entry is answered in it; other entries and the order are kept.
    """
    entries = []
    for entry in header.split(","):
        media, *params = (part.strip() for part in entry.split(";"))
        if media.lower() == "application/openmetrics-text":
            params = ["version=1.0.0", *(p for p in params if not p.lower().startswith("version="))]
        entries.append(";".join([media, *params]))
    return ",".join(entries)


def openmetrics_handler(handler: type) -> type:
    """prometheus_client's WSGI request handler class `handler`, answering any OpenMetrics `Accept`
    in OpenMetrics (`openmetrics_accept`)."""

    class OpenMetricsHandler(handler):  # type: ignore[misc, valid-type]
        def get_environ(self) -> dict[str, Any]:
            environ = super().get_environ()
            if environ.get("HTTP_ACCEPT"):
                environ["HTTP_ACCEPT"] = openmetrics_accept(environ["HTTP_ACCEPT"])
            return environ

    return OpenMetricsHandler


@dataclass(frozen=True, slots=True)
class _Series:
    descriptor: MetricDescriptor
    name: str
    help: str
    label: str | None


class PrometheusCollector:
    """A prometheus_client collector over the reports; `collect()` returns a consistent snapshot.

    `set_descriptors()` checks names (collisions raise `NameCollisionError`), `set_report()`
    builds the families of a new report and swaps them in under a lock. A series keeps its
    last reported value until a report carries it again (a report of a framework's own logs
    does not hide the collected metrics), or until `retire()` drops it: a later window left it
    out. `set_finished()` adds the run's finished marker;
    each report is a new `generation`, and `taken_reading()` says which one the scrape served on
    this thread read (`_final_scrape.ScrapeLog` keeps who read what). Every series
    carries `run` (the run id) and `route` (which exporter exposes it: one of `ROUTES`).
    """

    def __init__(self, route: str, namespace: str = NAMESPACE) -> None:
        if route not in ROUTES:
            raise ValueError(f"PrometheusCollector: route must be one of {ROUTES}, got {route!r}")
        self._core = import_prometheus_client().metrics_core
        self._route = route
        self._namespace = namespace
        self._lock = threading.Lock()
        self._generation = 0
        self._reading = threading.local()
        self.scrapes = 0
        """`collect()` calls so far (scrapes of the endpoint, pushes to a gateway)."""
        self._series: dict[str, _Series] = {}
        self._run_id: str | None = None
        self._families: list[Any] = []
        self._latest: dict[str, Any] = {}
        self._fixed = {
            descriptor.name: self._make_series(descriptor)
            for descriptor in (STEP_METRIC, LAST_UPDATE_METRIC, RUN_FINISHED_METRIC)
        }

    def set_descriptors(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Add (or replace, by path) the descriptors; raise `NameCollisionError` on any clash."""
        known = {path: series.descriptor for path, series in self._series.items()}
        merged = merge_descriptors(
            known, descriptors, lambda d: prometheus_name(d, self._namespace), "Prometheus"
        )
        series = {path: self._make_series(descriptor) for path, descriptor in merged.items()}
        self._check_exposition(series)
        with self._lock:
            self._series = series
            self._run_id = run.run_id

    def set_report(self, step: int, values: ReportValues, timestamp: float) -> list[str]:
        """Make this report the one scrapes see; returns the problems of values left out (empty if none)."""
        problems: list[str] = []
        if self._run_id is None:
            return ["describe() was not called"]
        run = self._run_id
        fixed = [
            self._gauge_family(self._fixed[STEP_METRIC.name], run, float(step)),
            self._gauge_family(self._fixed[LAST_UPDATE_METRIC.name], run, float(timestamp)),
        ]
        updates = {}
        for path, value in values.items():
            series = self._series.get(path)
            if series is None:
                problems.append(f"{path!r} was not described")
                continue
            try:
                updates[path] = self._family(series, run, value)
            except (TypeError, ValueError) as error:
                problems.append(f"{path!r}: {error}")
        with self._lock:
            self._latest.update(updates)
            self._families = [*fixed, *self._latest.values()]
            self._generation += 1
        return problems

    def retire(self, names: frozenset[str]) -> None:
        """Drop the values of `names` from the next report's families on (the current report is
        served as it is until then)."""
        with self._lock:
            for name in names:
                self._latest.pop(name, None)

    def set_finished(self, timestamp: float) -> None:
        """Add `torchtelemetry_run_finished_timestamp_seconds` (the run closed at `timestamp`)."""
        if self._run_id is None:
            return
        family = self._gauge_family(self._fixed[RUN_FINISHED_METRIC.name], self._run_id, timestamp)
        with self._lock:
            self._families = [*self._families, family]
            self._generation += 1

    @property
    def generation(self) -> int:
        """The number of the latest report (each `set_report` and `set_finished` makes a new one)."""
        with self._lock:
            return self._generation

    def describe(self) -> list[Any]:
        """No fixed names to register: they follow the metric tree (prometheus_client's `describe`).

        Register it in a `CollectorRegistry(support_collectors_without_names=True)` for `name[]`
        filtering (`/metrics?name[]=...`) to find it.
        """
        return []

    def collect(self) -> list[Any]:
        """The families of the latest report (prometheus_client's `Collector` protocol)."""
        with self._lock:
            self.scrapes += 1
            self._reading.generation = self._generation
            return self._families

    def taken_reading(self) -> int | None:
        """The generation the last `collect()` on this thread read (None if none since the last
        call): once its response was sent whole, the report that scrape delivered."""
        generation = getattr(self._reading, "generation", None)
        self._reading.generation = None
        return generation

    def clear(self) -> None:
        """Forget every reported value."""
        with self._lock:
            self._families = []
            self._latest = {}

    def _make_series(self, descriptor: MetricDescriptor) -> _Series:
        help_text = descriptor.description or f"{descriptor.name} ({descriptor.kind.value})"
        label = None if descriptor.label_name is None else prometheus_label_name(descriptor.label_name)
        return _Series(descriptor, prometheus_name(descriptor, self._namespace), help_text, label)

    def _check_exposition(self, series: Mapping[str, _Series]) -> None:
        """Sample names and labels that would clash in the exposition, beyond family-name collisions."""
        owners: dict[str, list[str]] = {}
        for path, entry in [*self._fixed.items(), *series.items()]:
            if entry.label in (RUN_LABEL, ROUTE_LABEL, "le"):
                raise NameCollisionError(
                    f"Prometheus: metric {path!r} has label {entry.descriptor.label_name!r}, which maps to "
                    f"{entry.label!r}, a label the exporter sets itself; choose another label_name"
                )
            for sample in _sample_names(entry):
                owners.setdefault(sample, []).append(path)
        clashes = {sample: paths for sample, paths in owners.items() if len(paths) > 1}
        if clashes:
            listed = "; ".join(f"{paths} -> {sample!r}" for sample, paths in sorted(clashes.items()))
            raise NameCollisionError(
                f"Prometheus: series names collide ({listed}); "
                f"{STEP_METRIC.name!r} and {LAST_UPDATE_METRIC.name!r} are reserved; rename one of each"
            )

    def _gauge_family(self, series: _Series, run: str, value: float) -> Any:
        family = self._core.GaugeMetricFamily(series.name, series.help, labels=[RUN_LABEL, ROUTE_LABEL])
        family.add_metric([run, self._route], value)
        return family

    def _family(self, series: _Series, run: str, value: Any) -> Any:
        kind = series.descriptor.kind
        if kind is MetricKind.HISTOGRAM:
            if not isinstance(value, HistogramValue):
                raise TypeError(f"a histogram takes a HistogramValue, got {type(value).__name__}")
            family = self._core.HistogramMetricFamily(
                series.name, series.help, labels=[RUN_LABEL, ROUTE_LABEL]
            )
            family.add_metric([run, self._route], _buckets(value), value.sum)
            return family
        family_type = (
            self._core.CounterMetricFamily if kind is MetricKind.COUNTER else self._core.GaugeMetricFamily
        )
        if isinstance(value, Mapping):
            if series.label is None:
                raise TypeError("a value per label needs a descriptor with label_name")
            family = family_type(series.name, series.help, labels=[RUN_LABEL, ROUTE_LABEL, series.label])
            for label_value, entry in value.items():
                family.add_metric([run, self._route, str(label_value)], float(entry))
            return family
        if isinstance(value, HistogramValue):
            raise TypeError(f"a HistogramValue for a {kind.value}")
        family = family_type(series.name, series.help, labels=[RUN_LABEL, ROUTE_LABEL])
        family.add_metric([run, self._route], float(value))
        return family


def _sample_names(series: _Series) -> Iterator[str]:
    if series.descriptor.kind is MetricKind.HISTOGRAM:
        yield from (f"{series.name}_bucket", f"{series.name}_sum", f"{series.name}_count")
    else:
        yield series.name


def _buckets(value: HistogramValue) -> list[tuple[Any, ...]]:
    """`(le, cumulative count)` per bucket, and the exemplar on the bucket its value falls in (only
    the OpenMetrics exposition shows it, as `# {trace_id="...",span_id="..."} value timestamp`)."""
    client = import_prometheus_client()
    cumulative = value.cumulative_counts()
    if len(cumulative) != len(value.bounds) + 1:
        raise ValueError(
            f"{len(value.bounds)} bounds need {len(value.bounds) + 1} counts, got {len(cumulative)}"
        )
    edges = [client.utils.floatToGoString(bound) for bound in value.bounds] + ["+Inf"]
    buckets: list[tuple[Any, ...]] = list(zip(edges, cumulative, strict=True))
    index, exemplar = value.exemplar_bucket(), value.exemplar
    if index is not None and exemplar is not None:
        labels = {"trace_id": exemplar.trace_id, "span_id": exemplar.span_id}
        buckets[index] = (
            *buckets[index],
            client.samples.Exemplar(labels, exemplar.value, exemplar.timestamp),
        )
    return buckets
