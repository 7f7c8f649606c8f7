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

Gauges are OTLP gauges, counters are cumulative monotonic sums of the running
total, histograms are cumulative explicit-bucket histograms; all share the
start time of the exporter. A report that failed to reach the collector is
kept (values are cumulative or latest, so only the newest report matters) and
retried by `force_flush()` and by `close()`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from torchtelemetry._optional import import_optional
from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._otel_metric import otel_metric
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.report import (
    STEP_METRIC,
    MetricDescriptor,
    Scalars,
    merge_descriptors,
    otel_name,
)

__all__ = [
    "DEFAULT_SERVICE_NAME",
    "METRICS_PROTOCOL_ENV",
    "OTelExporter",
    "PROTOCOL_ENV",
    "SDK_DISABLED_ENV",
    "WORLD_SIZE_ATTRIBUTE",
]

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""Transport for every signal: `http/protobuf` (default) or `grpc`."""
METRICS_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
"""Transport for metrics; wins over `OTEL_EXPORTER_OTLP_PROTOCOL`."""
SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
"""`true` turns the exporter into a no-op (with a warning)."""
DEFAULT_SERVICE_NAME = "torchtelemetry"
"""`service.name` unless `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` or code says otherwise."""
WORLD_SIZE_ATTRIBUTE = "torchtelemetry.world_size"
"""Resource attribute holding the run's number of ranks."""

_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_METRICS_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
_PROTOCOLS = ("http/protobuf", "grpc")
_DEFAULT_PROTOCOL = "http/protobuf"
_COMPRESSIONS = ("none", "gzip", "deflate")


def _resolve_protocol(protocol: str | None) -> str:
    if protocol is not None:
        if protocol not in _PROTOCOLS:
            raise ValueError(f"OTelExporter: protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        return protocol
    for env in (METRICS_PROTOCOL_ENV, PROTOCOL_ENV):
        value = os.environ.get(env, "").strip().lower()
        if value in _PROTOCOLS:
            return value
        if value:
            logger.warning(
                "%s=%r is not supported by OTelExporter (use one of %s); using %s",
                env,
                value,
                _PROTOCOLS,
                _DEFAULT_PROTOCOL,
            )
            return _DEFAULT_PROTOCOL
    return _DEFAULT_PROTOCOL


def _has_user_info(url: str) -> bool:
    return "@" in urlsplit(url if "//" in url else f"//{url}").netloc


def _redact(url: str) -> str:
    """`url` with any `user:password@` masked, safe for logs."""
    if not _has_user_info(url):
        return url
    parts = urlsplit(url if "//" in url else f"//{url}")
    redacted = urlunsplit(parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}"))
    return redacted if "//" in url else redacted.removeprefix("//")


class OTelExporter(BaseExporter):
    """Pushes every report to an OpenTelemetry collector over OTLP (HTTP/protobuf or gRPC).

    Each argument beats its standard environment variable, which beats the
    default. `endpoint` is the metrics endpoint: for HTTP the full URL with
    `/v1/metrics` (like `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`), for gRPC
    `http://host:4317` (`http` means no TLS). Unset, the SDK reads
    `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` as is, else `OTEL_EXPORTER_OTLP_ENDPOINT`
    (HTTP appends `/v1/metrics`), else localhost. Headers, timeout and
    compression fall back to `OTEL_EXPORTER_OTLP_[METRICS_]HEADERS`, `_TIMEOUT`
    and `_COMPRESSION` the same way. Header values are never logged.

    The resource carries `service.name` ("torchtelemetry", overridden by
    `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`, then by `service_name`),
    `service.instance.id` (the run id), `torchtelemetry.world_size` and
    `process.pid`; `resource_attributes` override any of them.

    The constructor only checks its arguments; the OTLP client is created by the
    first `describe()`. Each `export()` is one blocking push bounded by the
    timeout (the SDK retries transient errors within it).
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
    ) -> None:
        self.protocol = _resolve_protocol(protocol)
        transport = "grpc" if self.protocol == "grpc" else "http"
        for module in (
            "opentelemetry.sdk.metrics.export",
            "opentelemetry.sdk.resources",
            f"opentelemetry.exporter.otlp.proto.{transport}.metric_exporter",
        ):
            import_optional(module, "otel", "OTelExporter")
        if compression is not None and compression not in _COMPRESSIONS:
            raise ValueError(f"OTelExporter: compression must be one of {_COMPRESSIONS}, got {compression!r}")
        if self.protocol == "grpc":
            target = endpoint or os.environ.get(_METRICS_ENDPOINT_ENV) or os.environ.get(_ENDPOINT_ENV) or ""
            if _has_user_info(target):
                raise ValueError(
                    "OTelExporter: a gRPC endpoint cannot carry credentials (user:password@host); "
                    "pass them as headers (headers= or OTEL_EXPORTER_OTLP_HEADERS)"
                )
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"OTelExporter: timeout_s must be positive, got {timeout_s}")
        super().__init__(name)
        self._endpoint = endpoint
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
        self._disabled = False
        self._pending: Any = None
        self._unknown_warned: set[str] = set()

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
            self._otlp = self._build_otlp_exporter()
        except Exception:
            logger.exception("OTelExporter %r: could not create the OTLP %s client", self.name, self.protocol)
            return
        self._start_ns = time.time_ns()
        header_names = sorted(self._headers or ())
        logger.info(
            "OTelExporter %r: OTLP %s to %s%s",
            self.name,
            self.protocol,
            _redact(str(getattr(self._otlp, "_endpoint", self._endpoint or "the default endpoint"))),
            f" with headers {header_names}" if header_names else "",
        )

    def _export(self, step: int, scalars: Scalars, timestamp: float) -> None:
        """Push one report; raises `ExportFailed` when the collector did not acknowledge it."""
        if self._disabled:
            return
        if self._otlp is None:
            raise ExportFailed("no OTLP client (creating it failed at describe()); nothing sent")
        self._push(self._metrics_data(step, scalars, timestamp))

    def _flush(self, timeout_s: float) -> bool:
        """Retry the newest report if its push failed; True when nothing is left undelivered."""
        if self._pending is None or self._otlp is None:
            return self._pending is None
        if timeout_s <= 0:
            return False
        self._push(self._pending)
        return True

    def _close(self, timeout_s: float) -> None:
        """Shut the OTLP client down."""
        if self._otlp is not None:
            otlp, self._otlp = self._otlp, None
            otlp.shutdown(timeout_millis=timeout_s * 1000)

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
                    }
                )
            )
            .merge(Resource(self._resource_overrides))
        )

    def _build_otlp_exporter(self) -> Any:
        if self.protocol == "grpc":
            import grpc
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            compressions = {
                "none": grpc.Compression.NoCompression,
                "gzip": grpc.Compression.Gzip,
                "deflate": grpc.Compression.Deflate,
            }
            headers = {k.lower(): v for k, v in self._headers.items()} if self._headers is not None else None
            return OTLPMetricExporter(
                endpoint=self._endpoint,
                headers=headers,
                timeout=self._timeout_s,
                compression=compressions[self._compression] if self._compression else None,
            )
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(
            endpoint=self._endpoint,
            headers=self._headers,
            timeout=self._timeout_s,
            compression=Compression(self._compression) if self._compression else None,
        )

    def _push(self, data: Any) -> None:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            result = self._otlp.export(data)
        except Exception as error:
            self._pending = data
            raise ExportFailed("OTLP export raised") from error
        if result is not MetricExportResult.SUCCESS:
            self._pending = data
            raise ExportFailed(f"OTLP export to the collector returned {result.name}")
        self._pending = None

    def _metrics_data(self, step: int, scalars: Scalars, timestamp: float) -> Any:
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from torchtelemetry import __version__

        now_ns = int(timestamp * 1e9)
        self._start_ns = min(self._start_ns, now_ns)
        metrics = [otel_metric(STEP_METRIC, int(step), self._start_ns, now_ns)]
        for path, value in scalars.items():
            descriptor = self._descriptors.get(path)
            if descriptor is None:
                if path not in self._unknown_warned:
                    self._unknown_warned.add(path)
                    logger.warning("OTelExporter %r: %r was never described; not exported", self.name, path)
                continue
            metrics.append(otel_metric(descriptor, value, self._start_ns, now_ns))
        scope = ScopeMetrics(
            scope=InstrumentationScope("torchtelemetry", __version__), metrics=metrics, schema_url=""
        )
        return MetricsData(
            resource_metrics=[ResourceMetrics(resource=self._resource, scope_metrics=[scope], schema_url="")]
        )
