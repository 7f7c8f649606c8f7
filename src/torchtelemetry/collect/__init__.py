"""Collection: snapshot, sync and compute off the training loop's critical path."""

from torchtelemetry.collect._collector import AsyncMetricCollector
from torchtelemetry.collect._results import to_python
from torchtelemetry.collect._transports import HOST_TRANSPORT_LIMIT_BYTES, CollectionError
from torchtelemetry.collect._window import STEPS_ENTRY, WindowMismatchError, WindowPlan, sync_and_compute

__all__ = [
    "HOST_TRANSPORT_LIMIT_BYTES",
    "STEPS_ENTRY",
    "AsyncMetricCollector",
    "CollectionError",
    "WindowMismatchError",
    "WindowPlan",
    "sync_and_compute",
    "to_python",
]
