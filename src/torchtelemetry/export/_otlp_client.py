"""The OpenTelemetry SDK's OTLP metric exporters, built so that the collector's answer is read.

The SDK reports SUCCESS for every 2xx (HTTP) or OK (gRPC) answer and drops the response body, but
a collector that accepted only part of a request says so in that body:
`ExportMetricsServiceResponse.partial_success` with `rejected_data_points` and an `error_message`.
`OtlpClient` keeps each response of a push (through a `requests` response hook for HTTP, through
the stub the exporter calls for gRPC) and hands the rejection back with the SDK's result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OtlpClient", "PartialSuccess", "grpc_options", "http_options"]


@dataclass(frozen=True, slots=True)
class PartialSuccess:
    """What the collector said it did not take from one push."""

    rejected_data_points: int
    error_message: str


class OtlpClient:
    """One OTLP metric exporter of the SDK (`protocol` "http/protobuf" or "grpc") and the answers
    to its pushes. Used by one thread at a time (the exporter's hub thread)."""

    def __init__(
        self,
        protocol: str,
        endpoint: str,
        headers: Mapping[str, str] | None,
        timeout_s: float | None,
        compression: str | None,
    ) -> None:
        self._responses: list[Any] = []
        """The `partial_success` of every response to the push under way."""
        if protocol == "grpc":
            self._exporter = _grpc_exporter(endpoint, headers, timeout_s, compression, self._responses)
        else:
            self._exporter = _http_exporter(endpoint, headers, timeout_s, compression, self._responses)

    def export(self, data: Any) -> tuple[Any, PartialSuccess | None]:
        """Push `data` (SDK `MetricsData`): the SDK's `MetricExportResult`, and what the collector
        rejected of it (None when it rejected nothing)."""
        self._responses.clear()
        result = self._exporter.export(data)
        rejected = sum(partial.rejected_data_points for partial in self._responses)
        if not rejected:
            return result, None
        messages = [partial.error_message for partial in self._responses if partial.error_message]
        return result, PartialSuccess(rejected, "; ".join(messages))

    def shutdown(self, timeout_s: float) -> None:
        self._exporter.shutdown(timeout_millis=timeout_s * 1000)


def _http_exporter(
    endpoint: str,
    headers: Mapping[str, str] | None,
    timeout_s: float | None,
    compression: str | None,
    responses: list[Any],
) -> Any:
    import requests
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

    def keep_answer(response: Any, *args: Any, **kwargs: Any) -> None:
        if response.ok and response.content:
            try:
                answer = ExportMetricsServiceResponse.FromString(response.content)
            except Exception:  # not protobuf (a proxy's page): nothing to learn from it
                return
            responses.append(answer.partial_success)

    session = requests.Session()
    session.hooks["response"].append(keep_answer)
    return OTLPMetricExporter(
        endpoint=endpoint, timeout=timeout_s, session=session, **http_options(headers, compression)
    )


def _grpc_exporter(
    endpoint: str,
    headers: Mapping[str, str] | None,
    timeout_s: float | None,
    compression: str | None,
    responses: list[Any],
) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    class AnsweringStub:
        """The SDK's `MetricsServiceStub`, keeping what each `Export` call answered."""

        def __init__(self, stub: Any) -> None:
            self._stub = stub

        def Export(self, *args: Any, **kwargs: Any) -> Any:  # the gRPC method, as the stub names it
            answer = self._stub.Export(*args, **kwargs)
            responses.append(answer.partial_success)
            return answer

    class AnsweredExporter(OTLPMetricExporter):
        """The SDK exporter; whenever it (re)creates its stub, the stub is wrapped."""

        @property
        def _client(self) -> Any:
            return self.__dict__.get("_answering_client")

        @_client.setter
        def _client(self, stub: Any) -> None:
            self.__dict__["_answering_client"] = None if stub is None else AnsweringStub(stub)

    return AnsweredExporter(endpoint=endpoint, timeout=timeout_s, **grpc_options(headers, compression))


def grpc_options(headers: Mapping[str, str] | None, compression: str | None) -> dict[str, Any]:
    """The `headers` (metadata keys are lower-case) and `compression` arguments of the SDK's OTLP/gRPC
    exporters (None: the SDK reads its variables)."""
    import grpc

    compressions = {
        "none": grpc.Compression.NoCompression,
        "gzip": grpc.Compression.Gzip,
        "deflate": grpc.Compression.Deflate,
    }
    return {
        "headers": {k.lower(): v for k, v in headers.items()} if headers is not None else None,
        "compression": compressions[compression] if compression else None,
    }


def http_options(headers: Mapping[str, str] | None, compression: str | None) -> dict[str, Any]:
    """The `headers` and `compression` arguments of the SDK's OTLP/HTTP exporters."""
    from opentelemetry.exporter.otlp.proto.http import Compression

    return {"headers": headers, "compression": Compression(compression) if compression else None}
