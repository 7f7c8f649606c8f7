"""Where and how `OTelExporter` sends: protocol, the OTLP endpoint rule, temporality preference.

One endpoint rule for the API, the CLI and the docs, the OpenTelemetry one: a metrics-specific
endpoint (`OTelExporter(endpoint=...)`, `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`) is used as is; the
generic `OTEL_EXPORTER_OTLP_ENDPOINT` (what the demo's `--otlp` sets) gets `/v1/metrics` appended
for OTLP/HTTP, unless it already ends with it (never doubled); gRPC endpoints are used as is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ENDPOINT_ENV",
    "METRICS_ENDPOINT_ENV",
    "METRICS_PROTOCOL_ENV",
    "PROTOCOL_ENV",
    "TEMPORALITY_ENV",
    "has_user_info",
    "metrics_endpoint",
    "redact_url",
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
TEMPORALITY_ENV = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
"""`cumulative` (default), `delta` or `lowmemory`: counters and histograms as deltas in the latter two."""

_HTTP_PATH = "/v1/metrics"
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


def has_user_info(url: str) -> bool:
    """Whether `url` carries `user:password@`."""
    return "@" in urlsplit(url if "//" in url else f"//{url}").netloc


def redact_url(url: str) -> str:
    """`url` with any `user:password@` masked, safe for logs."""
    if not has_user_info(url):
        return url
    parts = urlsplit(url if "//" in url else f"//{url}")
    redacted = urlunsplit(parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}"))
    return redacted if "//" in url else redacted.removeprefix("//")
