"""`OTelExporter`: OTLP over HTTP or gRPC through the OpenTelemetry SDK's own OTLP exporters.

Each report becomes one SDK `MetricsData` handed straight to the OTLP
exporter's `export()`, on the caller's (the hub's) thread. No `MeterProvider`
and no periodic reader are involved, for two reasons:

- a `HistogramMetric` arrives already aggregated (bucket counts, sum, count),
  and an SDK `Histogram` instrument only records individual values, so the
  exact counts and the metric's own boundaries can only reach the wire as a
  pre-built `HistogramDataPoint`;
- nothing runs in the background: no thread is started, so a forked DataLoader
  worker never inherits a second exporter, and the outcome of every push is the
  OTLP exporter's own `MetricExportResult`, not a `force_flush()` boolean.

Gauges are OTLP gauges, counters are monotonic sums, histograms are
explicit-bucket histograms: cumulative running totals sharing the start time of
the exporter, or, when `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE` is
`delta` or `lowmemory`, deltas since the last delivered report (the hub hands
them over, `preferred_temporality`). A report that failed to reach the collector
is kept (values are cumulative or latest, so only the newest report matters) and
retried by `force_flush()` and by `close()`; with deltas, a later report carries
the failed one's increments, so it is retried only by `close()`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torchtelemetry._optional import import_optional
from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._naming import STEP_METRIC, merge_descriptors, otel_name
from torchtelemetry.export._otel_metric import otel_metric
from torchtelemetry.export._otlp_client import OtlpClient
from torchtelemetry.export._otlp_settings import (
    METRICS_PROTOCOL_ENV,
    PROTOCOL_ENV,
    TRACES_HEADERS_ENV,
    check_endpoint,
    check_headers,
    metrics_endpoint,
    resolve_protocol,
    temporality_preference,
)
from torchtelemetry.export._otlp_settings import traces_endpoint as traces_endpoint_of
from torchtelemetry.export._otlp_spans import OtlpSpanSender
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.export._temporality import Temporality
from torchtelemetry.export._urls import redact_url
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "METRICS_PROTOCOL_ENV",
    "OTEL_SCHEMA_URL",
    "OTelExporter",
    "PROTOCOL_ENV",
    "SDK_DISABLED_ENV",
    "WORLD_SIZE_ATTRIBUTE",
]

logger = logging.getLogger(__name__)

SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
"""`true` turns the exporter into a no-op (with a warning)."""
DEFAULT_SERVICE_NAME = "torchtelemetry"
"""`service.name` unless `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` or code says otherwise."""
WORLD_SIZE_ATTRIBUTE = "torchtelemetry.world_size"
"""Resource attribute holding the run's number of ranks."""
OTEL_SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
"""Schema URL of the resource: the semantic conventions its attribute names follow (`service.name`,
`service.instance.id`, `process.pid`, the SDK's `telemetry.sdk.*`), the newest version that the
opentelemetry-semantic-conventions package paired with the SDK installed here (0.66b2 with 1.45)
knows. Metric names are the library's own (exporters/signals.json), so the scope carries none."""

_COMPRESSIONS = ("none", "gzip", "deflate")


class OTelExporter(BaseExporter):
    """Pushes every report to an OpenTelemetry collector over OTLP (HTTP/protobuf or gRPC).

    Each argument beats its standard environment variable, which beats the
    default. `endpoint` is the metrics endpoint, used as is: for HTTP the full URL
    with `/v1/metrics` (like `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`), for gRPC
    `http://host:4317` (`http` means no TLS). Unset, `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`
    is used as is, else `OTEL_EXPORTER_OTLP_ENDPOINT` (HTTP appends `/v1/metrics`
    unless it ends with it already), else localhost; `url` shows the result.
    Headers, timeout and compression fall back to `OTEL_EXPORTER_OTLP_[METRICS_]HEADERS`,
    `_TIMEOUT` and `_COMPRESSION` the same way. Header values are never logged: one the transport
    cannot send as given (a token read from a file with its trailing newline) is refused here, with
    a `ValueError` naming the header, before the SDK would log it. An endpoint with a query string
    (`?api_key=...`) is refused too: the SDK logs the query with each failed push; a token goes in a
    header.
    `OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE` (`cumulative`, `delta`,
    `lowmemory`) is honoured as the specification defines it for synchronous
    counters and histograms.

    The resource carries `service.name` ("torchtelemetry", overridden by
    `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, then by `service_name`),
    `service.instance.id` (the run id), `torchtelemetry.world_size` and
    `process.pid`; `resource_attributes` override any of them. Its schema URL is
    `OTEL_SCHEMA_URL`.

    The constructor only checks its arguments; the OTLP client is created by the
    first `describe()`. Each `export()` is one blocking push bounded by the
    timeout (the SDK retries transient errors within it).

    The run's traces (`TelemetryConfig.trace_ranks`) go to `traces_endpoint`, else
    `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else where the metrics go (the same gRPC endpoint; over
    HTTP `/v1/traces` in place of `/v1/metrics`), with the same protocol, headers (or
    `OTEL_EXPORTER_OTLP_TRACES_HEADERS`), timeout, compression and resource: `span_sender()`.
    """

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        compression: str | None = None,
        service_name: str | None = None,
        resource_attributes: Mapping[str, str | bool | int | float] | None = None,
        name: str = "otlp",
        traces_endpoint: str | None = None,
    ) -> None:
        self.protocol = resolve_protocol(protocol)
        transport = "grpc" if self.protocol == "grpc" else "http"
        for module in (
            "opentelemetry.sdk.metrics.export",
            "opentelemetry.sdk.resources",
            f"opentelemetry.exporter.otlp.proto.{transport}.metric_exporter",
        ):
            import_optional(module, "otel", "OTelExporter")
        if compression is not None and compression not in _COMPRESSIONS:
            raise ValueError(f"OTelExporter: compression must be one of {_COMPRESSIONS}, got {compression!r}")
        self.endpoint = metrics_endpoint(self.protocol, endpoint)
        """The metrics endpoint, resolved by the OTLP rule (may hold credentials: log `url`)."""
        self.traces_endpoint = traces_endpoint_of(self.protocol, traces_endpoint, self.endpoint)
        """Where `span_sender()` sends spans (None: an HTTP metrics endpoint on another path than
        `/v1/metrics`, with no traces endpoint given)."""
        check_endpoint(self.endpoint, self.protocol)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"OTelExporter: timeout_s must be positive, got {timeout_s}")
        check_headers(headers, self.protocol)
        super().__init__(name)
        self.temporality = temporality_preference()
        """`cumulative`, `delta` or `lowmemory` (`OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`)."""
        if self.temporality != "cumulative":  # counters and histograms are synchronous instruments
            self.preferred_temporality = dict.fromkeys(
                (MetricKind.COUNTER, MetricKind.HISTOGRAM), Temporality.DELTA
            )
        self._headers = dict(headers) if headers is not None else None
        self._timeout_s = timeout_s
        self._compression = compression
        self._resource_overrides: dict[str, Any] = dict(resource_attributes or {})
        if service_name is not None:
            self._resource_overrides.setdefault("service.name", service_name)
        self._descriptors: dict[str, MetricDescriptor] = {}
        self._otlp: Any = None
        self._resource: Any = None
        self._start_ns = 0
        self._delta_start_ns = 0
        self._disabled = False
        self._pending: Any = None
        self._rejected = False
        """The collector rejected part of the newest report (OTLP partial success)."""
        self._reported = False
        self._unknown_warned: set[str] = set()

    @property
    def url(self) -> str:
        """The metrics endpoint with its secrets masked (`redact_url`: user information, query values):
        what logs, errors and the demo show."""
        return redact_url(self.endpoint)

    def destination(self) -> str | None:
        return self.url

    def span_sender(self) -> OtlpSpanSender:
        """A sender of finished spans to `traces_endpoint` with this exporter's settings and resource
        (for the run's traces: every rank builds one, a sampled rank sends). Raises a `ValueError`
        when the traces endpoint is unknown or has a query, or a traces header cannot be sent."""
        if self.traces_endpoint is None:
            raise ValueError(
                f"OTelExporter: no traces endpoint: the metrics endpoint {self.url} does not end in "
                "/v1/metrics, so where spans go is unknown; pass OTelExporter(traces_endpoint=...) or set "
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or turn traces off with trace_ranks=0"
            )
        check_endpoint(self.traces_endpoint, self.protocol)
        check_headers(self._headers, self.protocol, signal_variable=TRACES_HEADERS_ENV)
        settings = (self._headers, self._timeout_s, self._compression)
        return OtlpSpanSender(self.protocol, self.traces_endpoint, *settings, self._build_resource)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._descriptors = merge_descriptors(
            self._descriptors, descriptors, otel_name, "OpenTelemetry", reserved=[STEP_METRIC]
        )

    def _start(self, run: RunInfo) -> None:
        """Create the OTLP client; a failure is logged and every export then fails."""
        if os.environ.get(SDK_DISABLED_ENV, "").strip().lower() == "true":
            logger.warning("OTelExporter %r: %s=true, nothing will be exported", self.name, SDK_DISABLED_ENV)
            self._disabled = True
            return
        try:
            self._resource = self._build_resource(run)
            self._otlp = OtlpClient(
                self.protocol, self.endpoint, self._headers, self._timeout_s, self._compression
            )
        except Exception:
            logger.exception("OTelExporter %r: could not create the OTLP %s client", self.name, self.protocol)
            return
        self._start_ns = self._delta_start_ns = int(wall_time() * 1e9)
        header_names = sorted(self._headers or ())
        logger.info(
            "OTelExporter %r: OTLP %s to %s, %s temporality%s",
            self.name,
            self.protocol,
            self.url,
            self.temporality,
            f" with headers {header_names}" if header_names else "",
        )

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Push one report; raises `ExportFailed` when the collector did not acknowledge it."""
        if self._disabled:
            return
        if self._otlp is None:
            raise ExportFailed("no OTLP client (creating it failed at describe()); nothing sent")
        self._push(self._metrics_data(step, values, timestamp))

    def _flush(self, timeout_s: float) -> bool:
        """Retry the newest report if its push failed; True when nothing is left undelivered.

        With deltas, only at close: before that, the next report carries the failed one's increments.
        False while the collector's answer to the newest report rejected part of it.
        """
        if self._rejected:
            return False  # the newest report was delivered in part only, and is not sent again
        if self._pending is None or self._otlp is None:
            return self._pending is None
        if timeout_s <= 0 or (self.temporality != "cumulative" and not self.closed):
            return False
        self._push(self._pending)
        return True

    def _close(self, timeout_s: float) -> None:
        """Shut the OTLP client down."""
        if self._otlp is not None:
            otlp, self._otlp = self._otlp, None
            otlp.shutdown(timeout_s)

    def _build_resource(self, run: RunInfo) -> Any:
        from opentelemetry.sdk.resources import (
            PROCESS_PID,
            SERVICE_INSTANCE_ID,
            SERVICE_NAME,
            OTELResourceDetector,
            Resource,
        )

        # Default name < OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES < the run's identity < code.
        return (
            Resource.create({SERVICE_NAME: DEFAULT_SERVICE_NAME})
            .merge(OTELResourceDetector().detect())
            .merge(
                Resource(
                    {
                        SERVICE_INSTANCE_ID: run.run_id,
                        WORLD_SIZE_ATTRIBUTE: run.world_size,
                        PROCESS_PID: os.getpid(),
                    },
                    OTEL_SCHEMA_URL,
                )
            )
            .merge(Resource(self._resource_overrides))
        )

    def _push(self, report: tuple[Any, int]) -> None:
        """Push `(MetricsData, its time)`; raises `ExportFailed` naming the URL when not acknowledged."""
        from opentelemetry.sdk.metrics.export import MetricExportResult

        data, time_ns = report
        try:
            result, partial = self._otlp.export(data)
        except Exception as error:
            self._pending = report
            raise ExportFailed(f"OTLP {self.protocol} push to {self.url} failed") from error
        if result is not MetricExportResult.SUCCESS:
            self._pending = report
            raise ExportFailed(
                f"OTLP {self.protocol} push to {self.url} failed: {result.name} (the SDK logged why)"
            )
        self._pending = None
        self._delta_start_ns = time_ns
        self._rejected = partial is not None
        if partial is not None:  # OTLP: a partially rejected request must not be retried
            points = sum(
                len(metric.data.data_points)
                for resource in data.resource_metrics
                for scope in resource.scope_metrics
                for metric in scope.metrics
            )
            raise ExportFailed(
                f"the collector at {self.url} rejected {partial.rejected_data_points} of {points} data "
                f"points (OTLP partial success, not retried): {partial.error_message or 'no message'}"
            )

    def _metrics_data(self, step: int, values: ReportValues, timestamp: float) -> tuple[Any, int]:
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from torchtelemetry._version import __version__

        now_ns = int(timestamp * 1e9)
        if not self._reported:  # a caller's first timestamp may predate the client: start there
            self._reported = True
            self._start_ns = self._delta_start_ns = min(self._start_ns, now_ns)
        # After that the start of a series never moves (a consumer would read a reset) and no
        # point lies before it, whatever timestamps a caller passes (Telemetry's never go back).
        now_ns = max(now_ns, self._delta_start_ns)
        delta = self.temporality != "cumulative"
        metrics = [otel_metric(STEP_METRIC, int(step), self._start_ns, now_ns)]
        for path, value in values.items():
            descriptor = self._descriptors.get(path)
            if descriptor is None:
                if path not in self._unknown_warned:
                    self._unknown_warned.add(path)
                    logger.warning("OTelExporter %r: %r was never described; not exported", self.name, path)
                continue
            if delta and descriptor.kind is not MetricKind.GAUGE:
                metrics.append(otel_metric(descriptor, value, self._delta_start_ns, now_ns, delta=True))
            else:
                metrics.append(otel_metric(descriptor, value, self._start_ns, now_ns))
        scope = ScopeMetrics(
            scope=InstrumentationScope("torchtelemetry", __version__), metrics=metrics, schema_url=""
        )
        data = MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=self._resource, scope_metrics=[scope], schema_url=self._resource.schema_url
                )
            ]
        )
        return data, now_ns
