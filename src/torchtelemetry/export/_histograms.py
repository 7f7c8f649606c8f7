"""Drawing a histogram in a tracker: finite edges for the open outer buckets (W&B, TensorBoard)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["histogram_edges"]


def histogram_edges(bounds: Sequence[float]) -> list[float]:
    """Bin edges from upper bounds; the two open outer buckets get finite edges.

    Trackers draw bins between finite edges, but the first bucket is (-inf, b0] and
    the last (b_last, +inf). Each outer bucket is drawn as wide as its
    neighbour: `b0 - (b1 - b0)` and `b_last + (b_last - b_before_last)`; with a
    single bound `b`, both are `max(|b|, 1)` wide. Counts are never moved, only
    the outer edges are chosen.
    """
    if len(bounds) >= 2:
        first, last = bounds[1] - bounds[0], bounds[-1] - bounds[-2]
    else:
        first = last = max(abs(bounds[0]), 1.0)
    return [bounds[0] - first, *bounds, bounds[-1] + last]
