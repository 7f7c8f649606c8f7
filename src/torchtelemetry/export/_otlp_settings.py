"""Where and how `OTelExporter` sends: protocol, the OTLP endpoint rule, temporality preference.

One endpoint rule for the API, the CLI and the docs, the OpenTelemetry one: a metrics-specific
endpoint (`OTelExporter(endpoint=...)`, `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) is used as is; the
generic `OTEL_EXPORTER_OTLP_ENDPOINT` (what the demo's `--otlp` sets) gets `/v1/metrics` appended
for OTLP/HTTP, unless it already ends with it (never doubled); gRPC endpoints are used as is.
Spans go to `OTelExporter(traces_endpoint=...)`, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, as is,
else where the metrics go: the same gRPC endpoint, the HTTP one with `/v1/traces` for `/v1/metrics`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from urllib.parse import unquote

from torchtelemetry.export._urls import has_user_info, redact_url

__all__ = [
    "ENDPOINT_ENV",
    "HEADERS_ENV",
    "METRICS_HEADERS_ENV",
    "METRICS_ENDPOINT_ENV",
    "METRICS_PROTOCOL_ENV",
    "PROTOCOL_ENV",
    "TEMPORALITY_ENV",
    "TRACES_ENDPOINT_ENV",
    "TRACES_HEADERS_ENV",
    "check_endpoint",
    "check_headers",
    "metrics_endpoint",
    "traces_endpoint",
    "resolve_protocol",
    "temporality_preference",
]

logger = logging.getLogger(__name__)

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""Transport for every signal: `http/protobuf` (default) or `grpc`."""
METRICS_PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
"""Transport for metrics; wins over `OTEL_EXPORTER_OTLP_PROTOCOL`."""
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Generic OTLP endpoint: `/v1/metrics` is appended for OTLP/HTTP."""
METRICS_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
"""Metrics endpoint, used as is; wins over `OTEL_EXPORTER_OTLP_ENDPOINT`."""
HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"
"""Headers for every signal, `name=value` pairs separated by commas, values URL-encoded."""
METRICS_HEADERS_ENV = "OTEL_EXPORTER_OTLP_METRICS_HEADERS"
"""Headers for metrics; wins over `OTEL_EXPORTER_OTLP_HEADERS`."""
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Traces endpoint, used as is; wins over the one derived from the metrics endpoint."""
TRACES_HEADERS_ENV = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
"""Headers for traces; wins over `OTEL_EXPORTER_OTLP_HEADERS`."""
TEMPORALITY_ENV = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
"""`cumulative` (default), `delta` or `lowmemory`: counters and histograms as deltas in the latter two."""

_HTTP_PATH = "/v1/metrics"
_HTTP_TRACES_PATH = "/v1/traces"
_DEFAULTS = {"http/protobuf": "http://localhost:4318/v1/metrics", "grpc": "http://localhost:4317"}
_TEMPORALITIES = ("cumulative", "delta", "lowmemory")


def metrics_endpoint(protocol: str, endpoint: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The metrics URL: the argument, else the metrics variable, else the generic one, else localhost."""
    if endpoint:
        return endpoint
    specific = environ.get(METRICS_ENDPOINT_ENV, "").strip()
    if specific:
        return specific
    generic = environ.get(ENDPOINT_ENV, "").strip()
    if not generic:
        return _DEFAULTS[protocol]
    if protocol == "grpc" or generic.rstrip("/").endswith(_HTTP_PATH):
        return generic
    return generic.rstrip("/") + _HTTP_PATH


def traces_endpoint(
    protocol: str, given: str | None, metrics: str, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The traces URL: `given`, else the traces variable, else the `metrics` endpoint's for gRPC, and
    for HTTP with `/v1/traces` in place of its `/v1/metrics`; None when an HTTP metrics endpoint on
    another path leaves it unknown."""
    if given:
        return given
    specific = environ.get(TRACES_ENDPOINT_ENV, "").strip()
    if specific:
        return specific
    if protocol == "grpc":
        return metrics
    base = metrics.rstrip("/")
    return base[: -len(_HTTP_PATH)] + _HTTP_TRACES_PATH if base.endswith(_HTTP_PATH) else None


def temporality_preference(environ: Mapping[str, str] = os.environ) -> str:
    """`cumulative`, `delta` or `lowmemory` from the environment; an unknown value warns and is cumulative.

    This exporter's counters and histograms are synchronous instruments in the spec's terms (they
    sum what the updates added), so `delta` and `lowmemory` both send them as deltas.
    """
    value = environ.get(TEMPORALITY_ENV, "").strip().lower()
    if not value:
        return "cumulative"
    if value not in _TEMPORALITIES:
        logger.warning("%s=%r is not one of %s; using cumulative", TEMPORALITY_ENV, value, _TEMPORALITIES)
        return "cumulative"
    return value


_PROTOCOLS = ("http/protobuf", "grpc")
_DEFAULT_PROTOCOL = "http/protobuf"


def resolve_protocol(protocol: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The argument, else the metrics variable, else the generic one, else `http/protobuf`; a bad
    variable warns and falls back."""
    if protocol is not None:
        if protocol not in _PROTOCOLS:
            raise ValueError(f"OTelExporter: protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        return protocol
    for env in (METRICS_PROTOCOL_ENV, PROTOCOL_ENV):
        value = environ.get(env, "").strip().lower()
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


# An HTTP token (RFC 9110); gRPC metadata keys are lower-case letters, digits, '-', '_' and '.'.
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_HEADER_NAME = {"http/protobuf": re.compile(_TOKEN), "grpc": re.compile(r"[0-9a-z_.-]+")}
# Printable ASCII without leading or trailing whitespace: what both transports carry as is.
_HEADER_VALUE = re.compile(r"(?:[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)?")
# The OpenTelemetry SDK's own liberal form of one `name=value` entry of the headers variables.
_ENV_VALUE = r"[\x20\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_ENV_ENTRY = re.compile(rf"[ \t]*({_TOKEN})[ \t]*=[ \t]*({_ENV_VALUE})[ \t]*")


def check_headers(
    headers: Mapping[str, str] | None,
    protocol: str,
    environ: Mapping[str, str] = os.environ,
    *,
    signal_variable: str = METRICS_HEADERS_ENV,
) -> None:
    """Raise a `ValueError` naming a header that the transport cannot send as given, in `headers`
    or in the headers variable the OpenTelemetry SDK would read (`signal_variable`, else the generic
    one); never its value (a token).

    The SDK itself logs a header value it cannot send (a bearer token read from a file keeps its
    trailing newline), and one it cannot parse from the variable: both are refused here first.
    """
    if protocol == "grpc":
        names = {name: name.lower() for name in headers or ()}
    else:
        names = {name: name for name in headers or ()}
    for given, name in names.items():
        _check_header(given, name, headers[given], protocol, "headers=")  # type: ignore[index]
    variable = signal_variable if environ.get(signal_variable) else HEADERS_ENV
    for position, entry in enumerate(re.split(r"[ \t]*,[ \t]*", environ.get(variable, "")), start=1):
        if not entry.strip():
            continue
        match = _ENV_ENTRY.fullmatch(entry)
        if match is None:
            shown = entry.split("=", 1)[0].strip() if "=" in entry else ""
            named = repr(shown) if _HEADER_NAME["http/protobuf"].fullmatch(shown) else f"entry {position}"
            raise ValueError(
                f"OTelExporter: {variable}: header {named} is not a name=value pair with a URL-encoded "
                "value (spaces as %20, no quotes, commas or semicolons); the value is not shown"
            )
        name = match.group(1).lower() if protocol == "grpc" else match.group(1)
        _check_header(match.group(1), name, unquote(match.group(2)).strip(), protocol, variable)


def _check_header(given: str, name: str, value: object, protocol: str, source: str) -> None:
    shown = repr(given) if _HEADER_NAME["http/protobuf"].fullmatch(given) else "with an illegal name"
    if not _HEADER_NAME[protocol].fullmatch(name):
        raise ValueError(
            f"OTelExporter: {source}: header {shown} is not a legal {protocol} header name "
            f"({'lower-case letters, digits, -, _ and .' if protocol == 'grpc' else 'an HTTP token'})"
        )
    if not isinstance(value, str) or not _HEADER_VALUE.fullmatch(value):
        raise ValueError(
            f"OTelExporter: {source}: the value of header {shown} cannot be sent: it must be printable "
            "ASCII without leading or trailing whitespace, and it holds a newline, another control "
            "character, non-ASCII or surrounding spaces (a token read from a file keeps its trailing "
            "newline: strip() it); the value is not shown"
        )


def check_endpoint(url: str, protocol: str) -> None:
    """Raise a `ValueError` for an endpoint whose query (or gRPC credentials) would reach the logs."""
    if "?" in url or "#" in url:
        raise ValueError(
            f"OTelExporter: the endpoint {redact_url(url)} has a query or a fragment; a "
            "token there would reach the logs (the OpenTelemetry SDK logs the URL's path and query "
            "with every failed push): pass it as a header, headers={'api-key': ...} or "
            "OTEL_EXPORTER_OTLP_HEADERS=api-key=... (the name your backend takes), and the endpoint "
            "without a query"
        )
    if protocol == "grpc" and has_user_info(url):
        raise ValueError(
            "OTelExporter: a gRPC endpoint cannot carry credentials (user:password@host); "
            "pass them as headers (headers= or OTEL_EXPORTER_OTLP_HEADERS)"
        )
