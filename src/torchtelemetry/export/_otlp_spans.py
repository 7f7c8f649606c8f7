"""Finished spans over OTLP: the OpenTelemetry SDK's own span exporters, fed spans built from times.

A span here is already over when it is made (its start and end were recorded by the timers), so no
tracer, context or span processor is involved: each `SpanRecord` becomes one SDK `ReadableSpan`
with the ids it was given, on the thread that calls `send` (the run's traces thread, never the
training thread), and a window's spans go out in one request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchtelemetry.export._otlp_client import grpc_options, http_options
from torchtelemetry.export._protocol import RunInfo

__all__ = ["OtlpSpanSender", "SpanRecord"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One finished span: its name, ids (a 128-bit trace id, 64-bit span ids), times and attributes."""

    name: str
    trace_id: int
    span_id: int
    parent_id: int | None
    """The parent span's id in the same trace; None for a root span."""
    start_ns: int
    """Unix nanoseconds."""
    end_ns: int
    attributes: Mapping[str, str | int]


class OtlpSpanSender:
    """Sends spans to `endpoint` over OTLP (`protocol` "http/protobuf" or "grpc") with the SDK's span
    exporter, created at the first `send`; `headers`, `timeout_s` and `compression` as the SDK takes
    them (None: its `OTEL_EXPORTER_OTLP_TRACES_*` variables, then the generic ones). `resource` builds
    the resource of a run's spans. One thread at a time."""

    def __init__(
        self,
        protocol: str,
        endpoint: str,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
        compression: str | None,
        resource: Callable[[RunInfo], Any],
    ) -> None:
        self.protocol = protocol
        self.endpoint = endpoint
        self._headers = headers
        self._timeout_s = timeout_s
        self._compression = compression
        self._resource = resource
        self._resources: dict[str, Any] = {}
        self._exporter: Any = None

    def send(self, spans: Sequence[SpanRecord], run: RunInfo) -> bool:
        """Push `spans` of `run` in one request; True when the receiver acknowledged them (the SDK
        logs why not)."""
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, TraceFlags

        from torchtelemetry._version import __version__

        if run.run_id not in self._resources:
            self._resources = {run.run_id: self._resource(run)}
        resource = self._resources[run.run_id]
        scope = InstrumentationScope("torchtelemetry", __version__)
        sampled = TraceFlags(TraceFlags.SAMPLED)

        def context(trace_id: int, span_id: int) -> Any:
            return SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled)

        readable = [
            ReadableSpan(
                name=span.name,
                context=context(span.trace_id, span.span_id),
                parent=None if span.parent_id is None else context(span.trace_id, span.parent_id),
                resource=resource,
                attributes=dict(span.attributes),
                start_time=span.start_ns,
                end_time=span.end_ns,
                instrumentation_scope=scope,
            )
            for span in spans
        ]
        return self._span_exporter().export(readable) is SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Close the exporter's connection (nothing to do before the first `send`)."""
        if self._exporter is not None:
            exporter, self._exporter = self._exporter, None
            exporter.shutdown()

    def _span_exporter(self) -> Any:
        if self._exporter is None:
            if self.protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                options = grpc_options(self._headers, self._compression)
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

                options = http_options(self._headers, self._compression)
            self._exporter = OTLPSpanExporter(endpoint=self.endpoint, timeout=self._timeout_s, **options)
        return self._exporter
