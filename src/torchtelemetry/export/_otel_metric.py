"""One report value as an OpenTelemetry SDK metric, exact: a histogram keeps its bounds and counts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtelemetry.export._naming import STEP_METRIC, otel_name, otel_unit
from torchtelemetry.metric import DEFAULT_LABEL_NAME, MetricKind
from torchtelemetry.report import HistogramValue, MetricDescriptor

__all__ = ["otel_metric"]


def otel_metric(
    descriptor: MetricDescriptor, value: Any, start_ns: int, now_ns: int, *, delta: bool = False
) -> Any:
    """One report value as an OpenTelemetry SDK `Metric`: a gauge, a monotonic sum (counters) or an
    explicit-bucket histogram, with the metric's own bounds and counts; sums and histograms are
    cumulative, or deltas over `start_ns`..`now_ns` when `delta`."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        NumberDataPoint,
        Sum,
    )

    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    if descriptor.kind is MetricKind.HISTOGRAM:
        if not isinstance(value, HistogramValue):
            raise TypeError(
                f"{descriptor.name!r}: a histogram needs a HistogramValue, got {type(value).__name__}"
            )
        point = HistogramDataPoint(
            attributes={},
            start_time_unix_nano=start_ns,
            time_unix_nano=now_ns,
            count=round(value.count),
            sum=value.sum,
            bucket_counts=[round(count) for count in value.counts],
            explicit_bounds=list(value.bounds),
            min=None,  # unknown: only bucket counts are kept
            max=None,
            exemplars=_exemplars(value, now_ns),
        )
        data: Any = Histogram(data_points=[point], aggregation_temporality=temporality)
    else:
        if isinstance(value, HistogramValue):
            raise TypeError(f"{descriptor.name!r}: described as a {descriptor.kind.value}, got a histogram")
        if isinstance(value, Mapping):
            label = descriptor.label_name or DEFAULT_LABEL_NAME
            points = [
                NumberDataPoint(
                    attributes={label: key},
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    value=float(entry),
                )
                for key, entry in value.items()
            ]
        else:
            number = value if descriptor is STEP_METRIC else float(value)  # the step stays an integer
            points = [
                NumberDataPoint(
                    attributes={}, start_time_unix_nano=start_ns, time_unix_nano=now_ns, value=number
                )
            ]
        if descriptor.kind is MetricKind.COUNTER:
            data = Sum(points, temporality, is_monotonic=True)
        else:
            data = Gauge(points)
    return Metric(
        name=otel_name(descriptor),
        description=descriptor.description,
        unit=otel_unit(descriptor.unit),
        data=data,
    )


def _exemplars(value: HistogramValue, now_ns: int) -> list[Any]:
    """The histogram's exemplar as the SDK's (the OTLP encoder sends its trace and span ids)."""
    from opentelemetry.sdk.metrics import Exemplar

    exemplar = value.exemplar
    if exemplar is None:
        return []
    return [
        Exemplar(
            filtered_attributes={},
            value=exemplar.value,
            time_unix_nano=min(round(exemplar.timestamp * 1e9), now_ns),
            span_id=int(exemplar.span_id, 16),
            trace_id=int(exemplar.trace_id, 16),
        )
    ]
