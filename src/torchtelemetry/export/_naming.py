"""How each backend spells a metric path, and the checks that two paths never share a spelling.

Prometheus gets `torchtelemetry_train_loss` (unit suffix, `_total` on counters), OpenTelemetry
`train.loss` with a UCUM unit, the experiment trackers (W&B, TensorBoard, MLflow) the path itself.
Each exporter checks its spellings when it learns the names, and duplicates raise one
`NameCollisionError` listing all. The rules of the path itself are `torchtelemetry.report`'s.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from torchtelemetry.metric import DEFAULT_LABEL_NAME, MetricKind
from torchtelemetry.report import (
    HistogramValue,
    MetricDescriptor,
    NameCollisionError,
    ReportValues,
    path_segment,
)

__all__ = [
    "LAST_UPDATE_METRIC",
    "NAMESPACE",
    "RUN_FINISHED_METRIC",
    "STEP_METRIC",
    "TrackerKeys",
    "check_unique",
    "merge_descriptors",
    "otel_name",
    "otel_unit",
    "prometheus_label_name",
    "prometheus_name",
    "tracker_label_name",
    "tracker_name",
]

logger = logging.getLogger(__name__)

NAMESPACE = "torchtelemetry"
"""Prefix of every Prometheus name the library emits."""

STEP_METRIC = MetricDescriptor("train/step", description="Training step of the latest report")
"""The step of each report, for backends without a step axis (`torchtelemetry_train_step`, `train.step`)."""

LAST_UPDATE_METRIC = MetricDescriptor(
    "last_update_timestamp", unit="seconds", description="Unix time at which the latest report was collected"
)
"""When the latest report was collected (`torchtelemetry_last_update_timestamp_seconds`): stall alerts."""

RUN_FINISHED_METRIC = MetricDescriptor(
    "run/finished_timestamp", unit="seconds", description="Unix time at which the run closed its telemetry"
)
"""Set when the run closes (`torchtelemetry_run_finished_timestamp_seconds`): finished, not stalled."""

_PROMETHEUS_ILLEGAL = re.compile(r"[^A-Za-z0-9_]")
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
    "watts": "W",
    "celsius": "Cel",
    "megahertz": "MHz",
}


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
    name = _snake(label).lstrip("_") or DEFAULT_LABEL_NAME
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
    label = path_segment(label_value)
    return f"{tracker_name(descriptor)}/{descriptor.label_name or DEFAULT_LABEL_NAME}_{label}"


class TrackerKeys:
    """The keys of one tracker run (W&B, TensorBoard, MLflow), each meaning one value for the whole run.

    A path is its key, a value per label one key per label (`tracker_label_name`), and with
    `histogram_fields` (MLflow: "count", "sum", "mean") a histogram one key per field
    (`train/h/count`), besides its own key if `histogram_key` (W&B and TensorBoard draw it and log its
    open outer buckets as `train/h/underflow` and `train/h/overflow`). `describe` raises
    `NameCollisionError` listing every key two metrics would share (a histogram's `x/count` and a
    metric `x/count`). Label values are only known per report: the first label value (or metric) to
    take a key keeps it for the run; a later label value that sanitizes to the same key (`a/b` after
    `a_b`) is left out of every report, logged once naming both, and listed by `keyed()` so that the
    exporter counts the report as failed.
    """

    def __init__(
        self, backend: str, histogram_fields: Sequence[str] = (), *, histogram_key: bool = False
    ) -> None:
        self.backend = backend
        self._histogram_fields = tuple(histogram_fields)
        self._histogram_key = histogram_key
        self._descriptors: dict[str, MetricDescriptor] = {}
        self._owners: dict[str, str] = {}  # key -> what it means: a path, or a path and label value
        self._refused: set[str] = set()

    @staticmethod
    def field_key(key: str, field: str) -> str:
        """A histogram field's key: `train/h` and "count" -> `train/h/count`."""
        return f"{key}/{field}"

    def describe(self, descriptors: Iterable[MetricDescriptor]) -> None:
        """Add (or replace) `descriptors`; raise `NameCollisionError` before anything changes."""
        merged = {**self._descriptors, **{descriptor.name: descriptor for descriptor in descriptors}}
        fixed = {key: owner for key, owner in self._owners.items() if owner not in merged}
        claims = [(owner, key) for key, owner in fixed.items()]
        for descriptor in merged.values():
            if descriptor.label_name is None:
                claims.extend((descriptor.name, key) for key in self._keys_of(descriptor))
        _raise_clashes(_by_key(claims), self.backend)
        self._descriptors = merged
        self._owners = {**fixed, **{key: owner for owner, key in claims}}

    def keyed(self, values: ReportValues) -> tuple[list[tuple[str, float | HistogramValue]], list[str]]:
        """Each value of a report with its key, and what was left out because its key means another value."""
        keyed: list[tuple[str, float | HistogramValue]] = []
        left_out: list[str] = []
        for path, value in values.items():
            descriptor = self._descriptors.get(path) or MetricDescriptor(path)
            if isinstance(value, Mapping):
                for label, entry in value.items():
                    owner = f"{path} {descriptor.label_name or DEFAULT_LABEL_NAME}={label!r}"
                    key = tracker_label_name(descriptor, label)
                    if self._claim(key, owner, left_out):
                        keyed.append((key, float(entry)))
            elif all([self._claim(key, path, left_out) for key in self._keys_of(descriptor, value)]):
                number = value if isinstance(value, HistogramValue) else float(value)
                keyed.append((tracker_name(descriptor), number))
        return keyed, left_out

    def _keys_of(self, descriptor: MetricDescriptor, value: object = None) -> list[str]:
        key = tracker_name(descriptor)
        histogram = isinstance(value, HistogramValue) or descriptor.kind is MetricKind.HISTOGRAM
        if histogram and self._histogram_fields:
            fields = [self.field_key(key, field) for field in self._histogram_fields]
            return [key, *fields] if self._histogram_key else fields
        return [key]

    def _claim(self, key: str, owner: str, left_out: list[str]) -> bool:
        """True if `key` means `owner` (claiming it when free); else note the clash, logged once."""
        taken = self._owners.setdefault(key, owner)
        if taken == owner:
            return True
        clash = f"{owner} takes the key {key!r} of {taken} and is left out"
        left_out.append(clash)
        if clash not in self._refused:
            self._refused.add(clash)
            logger.error("%s: %s (from now on, in every report)", self.backend, clash)
        return False


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
    by_backend = _by_key((descriptor.name, mapper(descriptor)) for descriptor in descriptors)
    _raise_clashes(by_backend, backend)
    return {paths[0]: name for name, paths in by_backend.items()}


def _by_key(claims: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Backend name -> the paths (or owners) that map to it, from (path, name) pairs."""
    by_key: dict[str, list[str]] = {}
    for path, key in claims:
        by_key.setdefault(key, []).append(path)
    return by_key


def _raise_clashes(by_key: Mapping[str, list[str]], backend: str) -> None:
    clashes = {name: paths for name, paths in by_key.items() if len(paths) > 1}
    if clashes:
        listed = "; ".join(f"{paths} -> {name!r}" for name, paths in sorted(clashes.items()))
        raise NameCollisionError(
            f"{backend}: metric names collide after mapping: {listed}; rename one of each"
        )
