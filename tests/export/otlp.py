"""OTLP test targets: a running receiver with the protocol it speaks, and what a report carried."""

from __future__ import annotations

from typing import Any, NamedTuple

from tests.receivers import metrics_by_name
from torchtelemetry.export import MetricDescriptor, OTelExporter

LOSS = MetricDescriptor("train/loss")


class Target(NamedTuple):
    """A running receiver, the protocol it speaks and the endpoint an exporter is given."""

    receiver: Any
    protocol: str
    endpoint: str

    def steps(self) -> list[int]:
        return [report_step(r.request) for r in self.receiver.received]


def otel_exporter(target: Target, **kwargs: Any) -> OTelExporter:
    """An `OTelExporter` sending to `target` with a 1 s timeout."""
    return OTelExporter(protocol=target.protocol, endpoint=target.endpoint, timeout_s=1, **kwargs)


def report_step(request: Any) -> int:
    """The step of one received OTLP request."""
    return metrics_by_name(request)["train.step"].gauge.data_points[0].as_int


def report_value(request: Any, name: str) -> float:
    """The gauge `name` of one received OTLP request."""
    return metrics_by_name(request)[name].gauge.data_points[0].as_double
