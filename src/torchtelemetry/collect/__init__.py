"""Collection: snapshot, sync and compute off the training loop's critical path."""

from torchtelemetry.collect._blocking import sync_and_compute
from torchtelemetry.collect._collector import AsyncMetricCollector
from torchtelemetry.collect._transports import (
    DEFAULT_MAX_PENDING,
    DEFAULT_TIMEOUT_S,
    HOST_TRANSPORT_LIMIT_BYTES,
    CollectionError,
    check_collection_limits,
)
from torchtelemetry.collect._window import STEPS_ENTRY, WindowMismatchError, WindowPlan

__all__ = [
    "DEFAULT_MAX_PENDING",
    "DEFAULT_TIMEOUT_S",
    "HOST_TRANSPORT_LIMIT_BYTES",
    "STEPS_ENTRY",
    "AsyncMetricCollector",
    "CollectionError",
    "WindowMismatchError",
    "WindowPlan",
    "check_collection_limits",
    "sync_and_compute",
]
