"""Trace and span ids from what every rank knows: the run, its attempt, the rank and the step.

Each step a sampled rank traces is one trace, its `train.step` span the root. The exporting rank
links the step-time histogram to a span another rank sent (the slowest rank's slowest step): with
ids derived from (run id, attempt, rank, step), and a child's from its trace id, name and place, any
rank computes any rank's ids alone, and nothing is communicated. BLAKE2b keeps them unique for all
practical purposes (a 128-bit trace id; two spans of one trace share a 64-bit id with odds of 2^-64)
and never zero, which OpenTelemetry reads as "no id".
"""

from __future__ import annotations

import hashlib

__all__ = ["hex_span_id", "hex_trace_id", "span_id", "trace_id"]


def _nonzero(data: str, size: int) -> int:
    value = int.from_bytes(hashlib.blake2b(data.encode(), digest_size=size).digest(), "big")
    return value or 1


def trace_id(run_id: str, attempt: int, rank: int, step: int) -> int:
    """The 128-bit id of the trace of `step` on `rank` in `attempt` of run `run_id`."""
    return _nonzero(f"torchtelemetry\0{run_id}\0{attempt}\0{rank}\0{step}", 16)


def span_id(trace: int, name: str, ordinal: int = 0) -> int:
    """The 64-bit id of the `ordinal`-th span named `name` in trace `trace` (0: the step's own span)."""
    return _nonzero(f"{trace:032x}\0{name}\0{ordinal}", 8)


def hex_trace_id(trace: int) -> str:
    """A trace id as W3C trace context writes it: 32 lower-case hex digits."""
    return f"{trace:032x}"


def hex_span_id(span: int) -> str:
    """A span id as W3C trace context writes it: 16 lower-case hex digits."""
    return f"{span:016x}"
