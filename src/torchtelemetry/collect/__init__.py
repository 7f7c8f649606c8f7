"""Collection: snapshot, sync and compute off the training loop's critical path."""

from torchtelemetry.collect._results import to_python

__all__ = ["to_python"]
