"""`PrometheusExporter`: rank 0 serves `/metrics`, one consistent step per scrape.

`PrometheusCollector` turns the latest report into metric families (gauges,
counters with `_total`, real histograms with cumulative `le` buckets, one series
per label value, a `run` label on every series and never the step as a label);
the scrape endpoint here and the Pushgateway exporter both expose it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtelemetry._optional import import_optional
from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import (
    LAST_UPDATE_METRIC,
    NAMESPACE,
    STEP_METRIC,
    HistogramValue,
    MetricDescriptor,
    NameCollisionError,
    Scalars,
    merge_descriptors,
    prometheus_label_name,
    prometheus_name,
)

__all__ = ["RUN_LABEL", "PrometheusCollector", "PrometheusExporter", "import_prometheus_client"]

logger = logging.getLogger(__name__)

RUN_LABEL = "run"
"""Label carrying `RunInfo.run_id` on every series."""


def import_prometheus_client() -> Any:
    """`prometheus_client`, or an ImportError that names the pip extra."""
    for module in ("prometheus_client.metrics_core", "prometheus_client.utils"):
        import_optional(module, "prometheus", "the Prometheus exporters")
    return import_optional("prometheus_client", "prometheus", "the Prometheus exporters")


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
    does not hide the collected metrics).
    """

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self._core = import_prometheus_client().metrics_core
        self._namespace = namespace
        self._lock = threading.Lock()
        self._series: dict[str, _Series] = {}
        self._run_id: str | None = None
        self._families: list[Any] = []
        self._latest: dict[str, Any] = {}
        self._fixed = {
            descriptor.name: self._make_series(descriptor) for descriptor in (STEP_METRIC, LAST_UPDATE_METRIC)
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

    def set_report(self, step: int, scalars: Scalars, timestamp: float) -> list[str]:
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
        for path, value in scalars.items():
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
        return problems

    def describe(self) -> list[Any]:
        """No fixed names to register: they follow the metric tree (prometheus_client's `describe`)."""
        return []

    def collect(self) -> list[Any]:
        """The families of the latest report (prometheus_client's `Collector` protocol)."""
        with self._lock:
            return self._families

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
            if entry.label in (RUN_LABEL, "le"):
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
        family = self._core.GaugeMetricFamily(series.name, series.help, labels=[RUN_LABEL])
        family.add_metric([run], value)
        return family

    def _family(self, series: _Series, run: str, value: Any) -> Any:
        kind = series.descriptor.kind
        if kind is MetricKind.HISTOGRAM:
            if not isinstance(value, HistogramValue):
                raise TypeError(f"a histogram takes a HistogramValue, got {type(value).__name__}")
            family = self._core.HistogramMetricFamily(series.name, series.help, labels=[RUN_LABEL])
            family.add_metric([run], _buckets(value), value.sum)
            return family
        family_type = (
            self._core.CounterMetricFamily if kind is MetricKind.COUNTER else self._core.GaugeMetricFamily
        )
        if isinstance(value, Mapping):
            if series.label is None:
                raise TypeError("a value per label needs a descriptor with label_name")
            family = family_type(series.name, series.help, labels=[RUN_LABEL, series.label])
            for label_value, entry in value.items():
                family.add_metric([run, str(label_value)], float(entry))
            return family
        if isinstance(value, HistogramValue):
            raise TypeError(f"a HistogramValue for a {kind.value}")
        family = family_type(series.name, series.help, labels=[RUN_LABEL])
        family.add_metric([run], float(value))
        return family


def _sample_names(series: _Series) -> Iterator[str]:
    if series.descriptor.kind is MetricKind.HISTOGRAM:
        yield from (f"{series.name}_bucket", f"{series.name}_sum", f"{series.name}_count")
    else:
        yield series.name


def _buckets(value: HistogramValue) -> list[tuple[str, float]]:
    float_to_go_string = import_prometheus_client().utils.floatToGoString
    cumulative = value.cumulative_counts()
    if len(cumulative) != len(value.bounds) + 1:
        raise ValueError(
            f"{len(value.bounds)} bounds need {len(value.bounds) + 1} counts, got {len(cumulative)}"
        )
    edges = [float_to_go_string(bound) for bound in value.bounds] + ["+Inf"]
    return list(zip(edges, cumulative, strict=True))


class PrometheusExporter(BaseExporter):
    """Serves the latest report on `http://addr:port/metrics` from a dedicated `CollectorRegistry`.

    Nothing is opened until `start()` or the first `describe()` (which only
    rank 0's hub makes). `port=0` picks a free port (read `.port` after start);
    `port=None` serves nothing and only registers the collector in `registry`,
    for an application that already serves that registry. The TLS options are
    prometheus_client's `start_http_server` options.
    """

    def __init__(
        self,
        port: int | None = 9464,
        addr: str = "127.0.0.1",
        *,
        namespace: str = NAMESPACE,
        registry: Any = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        client_cafile: str | None = None,
        client_capath: str | None = None,
        client_auth_required: bool = False,
        name: str = "prometheus",
    ) -> None:
        client = import_prometheus_client()
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(
                f"PrometheusExporter.port: must be in 0..65535 (0 picks a free port), got {port}"
            )
        if (certfile is None) != (keyfile is None):
            raise ValueError("PrometheusExporter: certfile and keyfile must be given together for TLS")
        if port is None and registry is None:
            raise ValueError("PrometheusExporter: port=None serves nothing; pass the registry= you serve")
        super().__init__(name)
        self.registry = registry if registry is not None else client.CollectorRegistry()
        self._port = port
        self._addr = addr
        self._tls = {
            "certfile": certfile,
            "keyfile": keyfile,
            "client_cafile": client_cafile,
            "client_capath": client_capath,
            "client_auth_required": client_auth_required,
        }
        self._collector = PrometheusCollector(namespace)
        self._registered = False
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        """The port served: the bound one after start (also for port=0), else the one asked for."""
        return self._server.server_port if self._server is not None else self._port

    @property
    def url(self) -> str | None:
        """`http(s)://addr:port/metrics` once serving, else None."""
        if self._server is None:
            return None
        scheme = "https" if self._tls["certfile"] else "http"
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return f"{scheme}://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Register the collector and start serving (idempotent); raises OSError if the port is taken."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"PrometheusExporter {self.name!r}: start() after close()")
            if not self._registered:
                self.registry.register(self._collector)
                self._registered = True
            if self._port is None or self._server is not None:
                return
            client = import_prometheus_client()
            self._server, self._thread = client.start_http_server(
                self._port, addr=self._addr, registry=self.registry, **self._tls
            )
            logger.info("PrometheusExporter %r: serving %s", self.name, self.url)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._collector.set_descriptors(descriptors, run)

    def _start(self, run: RunInfo) -> None:
        self.start()

    def _export(self, step: int, scalars: Scalars, timestamp: float) -> None:
        """Make this report the one scrapes see."""
        problems = self._collector.set_report(step, scalars, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")

    def _close(self, timeout_s: float) -> None:
        """Stop serving and unregister the collector."""
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if self._registered:
            self._registered = False
            self.registry.unregister(self._collector)
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout_s)
