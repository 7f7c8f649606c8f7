"""Collection: snapshot, sync and compute off the training loop's critical path."""

from torchtelemetry.collect._collector import AsyncMetricCollector, CollectionError
from torchtelemetry.collect._results import to_python

__all__ = ["AsyncMetricCollector", "CollectionError", "to_python"]
