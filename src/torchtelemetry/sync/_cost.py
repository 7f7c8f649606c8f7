"""What one window's exchange costs each rank: collectives, ring steps and bytes sent (a model).

gloo all-reduces with a ring (a reduce-scatter, then an all-gather): over `W` ranks, an
all-reduce of `n` bytes takes `2 (W - 1)` sequential steps, in which each rank sends
`2 (W - 1) / W x n` bytes. `WindowExchange` reduces a window either by ONE such all-reduce of the
`W x slot` gather buffer (each rank sends `2 (W - 1) x slot` bytes) or by one all-reduce per bucket
(`2 (W - 1) / W x slot` bytes, but `2 (W - 1)` steps per bucket). With a latency `alpha` per step
and a time `beta` per byte, a window takes `steps x alpha + bytes x beta`
(`WindowCost.seconds`), which is how `WindowExchange` chooses (`window_cost` gives its choice's
cost); docs/scale.md extrapolates it and checks it against bench/bench_scale.py.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LINK_BYTES_PER_S", "STEP_LATENCY_S", "WindowCost", "ring_all_reduce"]

STEP_LATENCY_S = 20e-6
"""`alpha`: one step of a gloo ring between hosts over TCP (a message and its hand-off)."""
LINK_BYTES_PER_S = 1.25e9
"""`1 / beta`: what one rank's link moves per second (10 Gb/s Ethernet, the host network gloo uses)."""


@dataclass(frozen=True, slots=True)
class WindowCost:
    """One rank's share of a window's exchange (or of one collective)."""

    collectives: int
    ring_steps: int
    """Sequential steps: each waits for the previous rank's message (the latency term)."""
    bytes_sent: float
    """Payload bytes this rank sends (gloo adds a small header per message)."""

    def __add__(self, other: WindowCost) -> WindowCost:
        return WindowCost(
            self.collectives + other.collectives,
            self.ring_steps + other.ring_steps,
            self.bytes_sent + other.bytes_sent,
        )

    def seconds(self, step_latency_s: float = STEP_LATENCY_S, bytes_per_s: float = LINK_BYTES_PER_S) -> float:
        """`ring_steps x alpha + bytes_sent x beta`."""
        return self.ring_steps * step_latency_s + self.bytes_sent / bytes_per_s


def ring_all_reduce(nbytes: int, world_size: int) -> WindowCost:
    """One ring all-reduce of `nbytes` over `world_size` ranks."""
    if world_size < 2:
        return WindowCost(0, 0, 0.0)
    return WindowCost(1, 2 * (world_size - 1), 2 * (world_size - 1) / world_size * nbytes)
