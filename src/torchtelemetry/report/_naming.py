"""Every naming rule in one place: metric paths, and how each backend spells them.

A metric path is slash-separated (`train/loss`). Prometheus gets
`torchtelemetry_train_loss` (unit suffix, `_total` on counters), OpenTelemetry
`train.loss` with a UCUM unit, the experiment trackers (W&B, TensorBoard, MLflow)
the path itself. Checks run as soon as the metric tree is known, and duplicates
raise one `NameCollisionError` listing all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

from torchtelemetry.metric import MetricKind
from torchtelemetry.report._values import MetricDescriptor

__all__ = [
    "MAX_NAME_LENGTH",
    "NAMESPACE",
    "LAST_UPDATE_METRIC",
    "STEP_METRIC",
    "InvalidMetricNameError",
    "NameCollisionError",
    "check_unique",
    "merge_descriptors",
    "otel_name",
    "otel_unit",
    "prometheus_label_name",
    "prometheus_name",
    "sanitize_path",
    "validate_path",
    "tracker_label_name",
    "tracker_name",
]

NAMESPACE = "torchtelemetry"
"""Prefix of every Prometheus name the library emits."""

MAX_NAME_LENGTH = 200
"""Longest metric path accepted (backends truncate or reject longer names)."""

STEP_METRIC = MetricDescriptor("train/step", description="Training step of the latest report")
"""The step of each report, for backends without a step axis (`torchtelemetry_train_step`, `train.step`)."""

LAST_UPDATE_METRIC = MetricDescriptor(
    "last_update_timestamp", unit="seconds", description="Unix time at which the latest report was collected"
)
"""When the latest report was collected (`torchtelemetry_last_update_timestamp_seconds`): stall alerts."""

_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_PROMETHEUS_ILLEGAL = re.compile(r"[^A-Za-z0-9_]")
_PATH_ILLEGAL = re.compile(r"[^A-Za-z0-9_.\-]+")
_UCUM = {
    "seconds": "s",
    "milliseconds": "ms",
    "bytes": "By",
    "ratio": "1",
    "percent": "%",
    "tokens": "{token}",
    "samples": "{sample}",
    "tokens_per_second": "{token}/s",
    "samples_per_second": "{sample}/s",
    "tflops_per_second": "{TFLOP}/s",
}


class InvalidMetricNameError(ValueError):
    """A metric path that no backend can carry."""


class NameCollisionError(ValueError):
    """Two metric paths map to one backend name."""


def validate_path(name: str) -> str:
    """Return `name` if it is a legal metric path, else raise `InvalidMetricNameError`."""
    if not isinstance(name, str) or not name:
        raise InvalidMetricNameError(f"metric name {name!r}: must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidMetricNameError(
            f"metric name {name[:40]!r}...: {len(name)} characters, at most {MAX_NAME_LENGTH} allowed"
        )
    for segment in name.split("/"):
        if not _SEGMENT.match(segment):
            raise InvalidMetricNameError(
                f"metric name {name!r}: segment {segment!r} must be non-empty and use only letters, "
                "digits, '_', '.', '-' (segments are separated by '/')"
            )
    return name


def sanitize_path(name: str) -> str:
    """A legal metric path from a framework's free-form key, or `InvalidMetricNameError`.

    `mfu(%)` -> `mfu_pct`, `memory/max_active(GiB)` -> `memory/max_active_GiB`.
    """
    segments = (_PATH_ILLEGAL.sub("_", segment.replace("%", "pct")).strip("_") for segment in name.split("/"))
    return validate_path("/".join(segment for segment in segments if segment))


def _snake(text: str) -> str:
    return _PROMETHEUS_ILLEGAL.sub("_", text)


def prometheus_name(descriptor: MetricDescriptor, namespace: str = NAMESPACE) -> str:
    """`train/loss` -> `torchtelemetry_train_loss`; unit suffix; `_total` only on counters."""
    name = _snake(descriptor.name)
    if namespace:
        name = f"{_snake(namespace)}_{name}"
    unit = _snake(descriptor.unit)
    if unit and not name.endswith(f"_{unit}"):
        name = f"{name}_{unit}"
    if descriptor.kind is MetricKind.COUNTER:
        name = name.removesuffix("_total") + "_total"
    return f"_{name}" if name[0].isdigit() else name


def prometheus_label_name(label: str) -> str:
    """A legal Prometheus label name (no `__` prefix, which Prometheus reserves)."""
    name = _snake(label).lstrip("_") or "label"
    return f"_{name}" if name[0].isdigit() else name


def otel_name(descriptor: MetricDescriptor) -> str:
    """`train/loss` -> `train.loss` (OpenTelemetry instrument names are dotted)."""
    return descriptor.name.replace("/", ".")


def otel_unit(unit: str) -> str:
    """The UCUM spelling of a unit ("seconds" -> "s"); unknown units pass through."""
    return _UCUM.get(unit, unit)


def tracker_name(descriptor: MetricDescriptor) -> str:
    """W&B, TensorBoard and MLflow keep the slash path: they group panels by the first segment."""
    return descriptor.name


def tracker_label_name(descriptor: MetricDescriptor, label_value: str) -> str:
    """One tracker key per label value: `train/step_time` at rank "0" -> `train/step_time/rank_0`.

    Characters outside letters, digits, '_', '.' and '-' in the label value become '_'
    (MLflow refuses a whole batch over one bad key; a '/' would add a path segment).
    """
    label = _PATH_ILLEGAL.sub("_", label_value)
    return f"{tracker_name(descriptor)}/{descriptor.label_name or 'label'}_{label}"


def merge_descriptors(
    known: Mapping[str, MetricDescriptor],
    descriptors: Iterable[MetricDescriptor],
    mapper: Callable[[MetricDescriptor], str],
    backend: str,
    *,
    reserved: Iterable[MetricDescriptor] = (),
) -> dict[str, MetricDescriptor]:
    """`known` with `descriptors` added or replaced by path, checked with `check_unique`
    (together with the backend's `reserved` names); raises before anything changes."""
    merged = {**known, **{descriptor.name: descriptor for descriptor in descriptors}}
    check_unique([*merged.values(), *reserved], mapper, backend)
    return merged


def check_unique(
    descriptors: Iterable[MetricDescriptor], mapper: Callable[[MetricDescriptor], str], backend: str
) -> dict[str, str]:
    """Map every path with `mapper`; raise one `NameCollisionError` listing every clash."""
    by_backend: dict[str, list[str]] = {}
    for descriptor in descriptors:
        by_backend.setdefault(mapper(descriptor), []).append(descriptor.name)
    clashes = {name: paths for name, paths in by_backend.items() if len(paths) > 1}
    if clashes:
        listed = "; ".join(f"{paths} -> {name!r}" for name, paths in sorted(clashes.items()))
        raise NameCollisionError(
            f"{backend}: metric names collide after mapping: {listed}; rename one of each"
        )
    return {paths[0]: name for name, paths in by_backend.items()}
