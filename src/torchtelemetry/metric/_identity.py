"""The identity of accumulators and their tensors: what a blocking call caches (packed views, a
layout) holds while these are the same objects."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtelemetry.metric._accumulator import MetricAccumulator

__all__ = ["same_identity", "state_identity", "synced_identity"]


def state_identity(accumulators: Iterable[MetricAccumulator]) -> tuple[object, ...]:
    """Each accumulator and its local tensor, in order: the same objects (`same_identity`) until an
    accumulator is replaced or moved (`to()`, `adopt()`). For what a blocking call caches."""
    return tuple(item for accumulator in accumulators for item in (accumulator, accumulator._local))


def synced_identity(accumulators: Iterable[MetricAccumulator]) -> tuple[object, ...]:
    """Each accumulator's synchronized tensor, in order: the same objects until one is moved (`to()`)
    or adopted (`adopt_synced()`) elsewhere."""
    return tuple(accumulator._synced for accumulator in accumulators)


def same_identity(first: tuple[object, ...], second: tuple[object, ...]) -> bool:
    """Whether two `state_identity`s hold the same objects (compared by `is`)."""
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))
