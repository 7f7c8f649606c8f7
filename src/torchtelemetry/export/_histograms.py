"""Drawing a histogram in a tracker without inventing edges (W&B, TensorBoard).

A histogram's first bucket is (-inf, b0] and its last (b_last, +inf): no finite edge is true for
them, and drawing the last as wide as its neighbour made up a bucket (4, 6] for values that may lie
anywhere above 4. Trackers draw the buckets between the bounds, exactly, and log the two open
buckets' counts as scalars of their own: `<path>/underflow` (values at or below the first bound)
and `<path>/overflow` (values above the last).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtelemetry.report import HistogramValue

__all__ = ["OUTER_BUCKET_FIELDS", "DrawnHistogram", "drawn_histogram"]

OUTER_BUCKET_FIELDS = ("underflow", "overflow")
"""Key suffixes (`<path>/underflow`, `<path>/overflow`) of the open buckets' counts."""


@dataclass(frozen=True, slots=True)
class DrawnHistogram:
    """What a tracker draws of a histogram, and the counts it logs beside it."""

    edges: tuple[float, ...]
    """The histogram's bounds: finite, and true edges of every drawn bucket."""
    counts: tuple[float, ...]
    """Values in each bucket between two bounds (`len(edges) - 1`; none for a single bound)."""
    underflow: float
    """Values at or below the first bound (the open first bucket)."""
    overflow: float
    """Values above the last bound (the open last bucket)."""


def drawn_histogram(value: HistogramValue) -> DrawnHistogram:
    """The buckets between `value`'s bounds, and the counts of its two open outer buckets."""
    return DrawnHistogram(
        edges=tuple(value.bounds),
        counts=tuple(value.counts[1:-1]),
        underflow=value.counts[0],
        overflow=value.counts[-1],
    )
