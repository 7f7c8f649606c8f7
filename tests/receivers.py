"""Real protocol peers for exporter tests: OTLP/HTTP and OTLP/gRPC receivers, a W&B offline-log reader.

The receivers bind 127.0.0.1, decode every `ExportMetricsServiceRequest` (HTTP `/v1/metrics`, the
gRPC `MetricsService`) and every `ExportTraceServiceRequest` (HTTP `/v1/traces`, the gRPC
`TraceService`) they get, and keep each with its headers: metrics in `received`, traces in
`received_traces` (`spans()` flattens them). `stop()` then `start()` brings a receiver
back on the same port, to simulate a collector outage. Use them as context
managers (or call `stop()` in a fixture's teardown).

The W&B reader parses an offline run's `run-<id>.wandb` transaction log: a
`:W&B` file header, then LevelDB-log style 32 KiB blocks holding
length-prefixed, CRC-checked chunks of protobuf `Record`s.
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.distributed import free_port

__all__ = [
    "OtlpGrpcReceiver",
    "OtlpHttpReceiver",
    "Received",
    "ReceivedSpan",
    "WandbRunLog",
    "any_value",
    "attributes",
    "find_wandb_logs",
    "metrics_by_name",
    "read_wandb_log",
    "read_wandb_records",
    "resource_attributes",
    "wait_for_wandb_logs",
]


@dataclass(frozen=True)
class Received:
    """One export request as the receiver decoded it."""

    request: Any
    """The `ExportMetricsServiceRequest` (or `ExportTraceServiceRequest`, in `received_traces`)."""
    headers: dict[str, str]
    """HTTP headers or gRPC metadata, keys lower-cased."""
    path: str = ""
    """HTTP request path (empty for gRPC)."""
    size: int = 0
    """Bytes of the request's protobuf body (uncompressed)."""


@dataclass(frozen=True)
class ReceivedSpan:
    """One span of a trace request, decoded: ids in hex, times in Unix nanoseconds."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    request: int
    """The position of its request in `received_traces`."""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def any_value(value: Any) -> Any:
    """A protobuf `AnyValue` as a Python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def attributes(key_values: Any) -> dict[str, Any]:
    """Repeated protobuf `KeyValue`s as a dict."""
    return {kv.key: any_value(kv.value) for kv in key_values}


def resource_attributes(request: Any) -> list[dict[str, Any]]:
    """The resource attributes of each `ResourceMetrics` of a request."""
    return [attributes(rm.resource.attributes) for rm in request.resource_metrics]


def metrics_by_name(request: Any) -> dict[str, Any]:
    """Every protobuf `Metric` of a request by name; a name sent twice is an error."""
    found: dict[str, Any] = {}
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name in found:
                    raise AssertionError(f"metric {metric.name!r} appears twice in one request")
                found[metric.name] = metric
    return found


_R = TypeVar("_R", bound="_Recorder")


class _Recorder:
    """What both receivers share: the received requests, a way to wait for them, the answer."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._received: list[Received] = []
        self._traces: list[Received] = []
        self.partial_success: tuple[int, str] | None = None
        """(rejected data points, error message) to answer every request with, or None: all taken."""

    def _answer(self, response_type: Any) -> Any:
        """The `ExportMetricsServiceResponse` to send back (trace requests are always taken whole)."""
        if self.partial_success is None:
            return response_type()
        rejected, message = self.partial_success
        return response_type(partial_success={"rejected_data_points": rejected, "error_message": message})

    def _record(self, received: Received, *, traces: bool = False) -> None:
        with self._lock:
            (self._traces if traces else self._received).append(received)
            self._lock.notify_all()

    @property
    def received(self) -> list[Received]:
        """Every metrics request received so far, in arrival order."""
        with self._lock:
            return list(self._received)

    @property
    def received_traces(self) -> list[Received]:
        """Every trace request received so far, in arrival order."""
        with self._lock:
            return list(self._traces)

    def spans(self) -> list[ReceivedSpan]:
        """Every span of every trace request so far, in arrival order."""
        found = []
        for position, received in enumerate(self.received_traces):
            for resource_spans in received.request.resource_spans:
                resource = attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(
                            ReceivedSpan(
                                span.name,
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                span.start_time_unix_nano,
                                span.end_time_unix_nano,
                                attributes(span.attributes),
                                resource,
                                position,
                            )
                        )
        return found

    def wait_for_traces(
        self, predicate: Callable[[list[Received]], bool], timeout_s: float = 30.0
    ) -> list[Received]:
        """Block until `predicate(received_traces)` holds; raise `TimeoutError` after `timeout_s`."""
        return self._wait(lambda: self._traces, predicate, timeout_s)

    def wait_for(
        self, predicate: Callable[[list[Received]], bool], timeout_s: float = 30.0
    ) -> list[Received]:
        """Block until `predicate(received)` holds; raise `TimeoutError` after `timeout_s`."""
        return self._wait(lambda: self._received, predicate, timeout_s)

    def _wait(
        self,
        requests: Callable[[], list[Received]],
        predicate: Callable[[list[Received]], bool],
        timeout_s: float,
    ) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not predicate(requests()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"receiver: condition not met after {timeout_s}s, {len(requests())} requests"
                    )
                self._lock.wait(remaining)
            return list(requests())

    def wait_for_count(self, count: int, timeout_s: float = 30.0) -> list[Received]:
        """Block until at least `count` requests arrived."""
        return self.wait_for(lambda received: len(received) >= count, timeout_s)

    def start(self) -> None:
        """Start serving (again, after `stop()`), on the same port."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop serving: new connections are refused, open ones dropped."""
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _ClosingHTTPServer(http.server.ThreadingHTTPServer):
    """Also drops open keep-alive connections on `close_connections()`, as a crashed collector would."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        with self._connections_lock:
            self._connections.add(connection)
        return connection, address

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()


class OtlpHttpReceiver(_Recorder):
    """OTLP/HTTP (protobuf) on 127.0.0.1: POST `/v1/metrics`, gzip and deflate bodies accepted.

    `status` is the HTTP status returned to exporters (set it to e.g. 503 to
    make the receiver refuse data while it stays reachable).
    """

    def __init__(self, port: int | None = None, *, status: int = 200) -> None:
        super().__init__()
        self.port = port or free_port()
        self.status = status
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """Base endpoint, as in `OTEL_EXPORTER_OTLP_ENDPOINT`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_endpoint(self) -> str:
        """Signal endpoint, as in `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`."""
        return f"{self.endpoint}/v1/metrics"

    def start(self) -> None:
        """Listen on `port` (again, after `stop()`)."""
        if self._server is not None:
            return
        self._server = _ClosingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-http-receiver",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening; connections are refused until `start()`."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._server = self._thread = None

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        signals = {
            "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse, False),
            "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse, True),
        }

        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path.rstrip("/") not in signals:
                    self._reply(404, b"")
                    return
                if receiver.status >= 300:
                    self._reply(receiver.status, b"")
                    return
                request_type, response_type, traces = signals[self.path.rstrip("/")]
                request = request_type()
                request.ParseFromString(body)
                headers = {key.lower(): value for key, value in self.headers.items()}
                receiver._record(Received(request, headers, self.path, len(body)), traces=traces)
                answer = response_type() if traces else receiver._answer(response_type)
                self._reply(200, answer.SerializeToString())

            def _reply(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: test output stays readable."""

        return Handler


class OtlpGrpcReceiver(_Recorder):
    """OTLP/gRPC on 127.0.0.1 (insecure): the `MetricsService` and `TraceService` with a real grpcio
    server."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__()
        self.port = port or free_port()
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        """`http://127.0.0.1:<port>`: what an OTLP/gRPC exporter is given (http means insecure)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve on `port` (again, after `stop()`)."""
        if self._server is not None:
            return
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        def record(request: Any, context: Any, traces: bool) -> None:
            headers = {key.lower(): value for key, value in context.invocation_metadata()}
            receiver._record(Received(request, headers, size=request.ByteSize()), traces=traces)

        class Servicer(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                record(request, context, False)
                return receiver._answer(metrics_service_pb2.ExportMetricsServiceResponse)

        class TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                record(request, context, True)
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Servicer(), server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceServicer(), server)
        if server.add_insecure_port(f"127.0.0.1:{self.port}") != self.port:
            raise OSError(f"OtlpGrpcReceiver: could not bind 127.0.0.1:{self.port}")
        server.start()
        self._server = server

    def stop(self) -> None:
        """Stop serving; calls fail with UNAVAILABLE until `start()`."""
        if self._server is None:
            return
        self._server.stop(grace=None).wait(timeout=10)
        self._server = None


# -- W&B offline transaction log ------------------------------------------------------

_BLOCK = 32768
_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
_CHUNK = struct.Struct("<IHB")  # crc32 of type byte + data, data length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes, path: Path) -> Iterator[tuple[int, bytes]]:
    index = _HEADER.size
    while index < len(data):
        space_left = _BLOCK - index % _BLOCK
        if space_left < _CHUNK.size:
            if data[index : index + space_left].strip(b"\0"):
                raise ValueError(f"{path}: non-zero block trailer at offset {index}")
            index += space_left
            continue
        if index + _CHUNK.size > len(data):
            raise ValueError(f"{path}: truncated chunk header at offset {index}")
        checksum, length, kind = _CHUNK.unpack_from(data, index)
        index += _CHUNK.size
        payload = data[index : index + length]
        if len(payload) != length:
            raise ValueError(f"{path}: truncated chunk at offset {index}")
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: bad checksum at offset {index}")
        index += length
        yield kind, payload


def read_wandb_records(path: str | Path) -> list[Any]:
    """Every `wandb_internal_pb2.Record` of a `.wandb` transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    path = Path(path)
    data = path.read_bytes()
    ident, magic, version = _HEADER.unpack_from(data)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log (header {ident!r} {magic:#x} v{version})")
    records, pending = [], b""
    for kind, payload in _chunks(data, path):
        if kind == _FULL:
            blob = payload
        elif kind == _FIRST:
            pending = payload
            continue
        elif kind == _MIDDLE:
            pending += payload
            continue
        elif kind == _LAST:
            blob, pending = pending + payload, b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind}")
        record = wandb_internal_pb2.Record()
        record.ParseFromString(blob)
        records.append(record)
    return records


def _set_nested(target: dict[str, Any], item: Any) -> None:
    keys = list(item.nested_key) or [item.key]
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = json.loads(item.value_json)


@dataclass
class WandbRunLog:
    """The parts of a W&B run's transaction log that tests look at."""

    path: Path
    records: list[Any]
    run_id: str = ""
    project: str = ""
    display_name: str = ""
    tags: list[str] = field(default_factory=list)
    resumed: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One dict per logged row (nested keys become nested dicts), with `_step`."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Summary after every update was applied."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """`define_metric` records (`MetricRecord`) by name or glob."""

    @property
    def steps(self) -> list[int]:
        """The `_step` of every history row."""
        return [row["_step"] for row in self.history]


def read_wandb_log(path: str | Path) -> WandbRunLog:
    """Parse a `.wandb` transaction log into run, config, history, summary and metric definitions."""
    log = WandbRunLog(Path(path), read_wandb_records(path))
    for record in log.records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            log.run_id, log.project, log.display_name = run.run_id, run.project, run.display_name
            log.tags = list(run.tags)
            log.resumed = log.resumed or run.resumed
            for item in run.config.update:
                _set_nested(log.config, item)
        elif kind == "config":
            for item in record.config.update:
                _set_nested(log.config, item)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _set_nested(row, item)
            log.history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _set_nested(log.summary, item)
        elif kind == "metric":
            metric = record.metric
            log.metrics[metric.name or metric.glob_name] = metric
    return log


def find_wandb_logs(wandb_dir: str | Path) -> list[Path]:
    """Every `run-*.wandb` log under `wandb_dir` (the `dir` given to W&B), oldest run first."""
    return sorted(Path(wandb_dir).glob("**/run-*.wandb"), key=lambda p: p.parent.name)


def wait_for_wandb_logs(wandb_dir: str | Path, count: int = 1, timeout_s: float = 60.0) -> list[WandbRunLog]:
    """The logs of `count` finished runs under `wandb_dir`, once each ends with its `exit` record.

    W&B's service may still be writing a log when `run.finish()` returns, so
    tests poll for the final record instead of reading at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        paths = find_wandb_logs(wandb_dir)
        logs = []
        for path in paths:
            try:
                logs.append(read_wandb_log(path))
            except (ValueError, struct.error):  # caught mid-write
                break
        finished = [
            log for log in logs if log.records and log.records[-1].WhichOneof("record_type") == "exit"
        ]
        if len(paths) == count and len(finished) == count:
            return finished
        if len(paths) > count:
            raise AssertionError(f"{len(paths)} W&B run logs under {wandb_dir}, expected {count}: {paths}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(finished)} of {count} finished W&B run logs under {wandb_dir} after {timeout_s}s"
            )
        time.sleep(0.02)
