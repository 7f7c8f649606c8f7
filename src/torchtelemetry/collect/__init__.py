"""Collection: snapshot, sync and compute off the training loop's critical path."""

from torchtelemetry.collect._collector import AsyncMetricCollector
from torchtelemetry.collect._results import to_python
from torchtelemetry.collect._transports import HOST_TRANSPORT_LIMIT_BYTES, CollectionError

__all__ = ["HOST_TRANSPORT_LIMIT_BYTES", "AsyncMetricCollector", "CollectionError", "to_python"]
