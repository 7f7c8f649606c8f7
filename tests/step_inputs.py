"""What the tests' training loops give `Telemetry.step()`: every step keyword of the built-in signals,
with the sample value its signal declares (`Signal.sample_inputs()`).

A loop that feeds every keyword writes `telemetry.step(step, **step_inputs(tokens=...))`, naming only
the values it asserts on, so a signal added with a keyword of its own is fed by every such loop
without being named there (tests/report/test_builtin_signals.py checks each keyword has a sample
its signal accepts).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from torchtelemetry.report.signals import SignalContext, builtin_signals


@cache
def _samples() -> dict[str, Any]:
    signals = builtin_signals(SignalContext(world_size=1, rank=0, device=torch.device("cpu")))
    try:
        return {keyword: value for signal in signals for keyword, value in signal.sample_inputs().items()}
    finally:
        for signal in signals:
            signal.close()


def step_inputs(**given: Any) -> dict[str, Any]:
    """Every built-in step keyword with its sample value, `given` in place of theirs (None: not given,
    as `Telemetry.step()` reads it)."""
    samples = _samples()
    unknown = sorted(given.keys() - samples.keys())
    if unknown:
        raise TypeError(f"step_inputs: no built-in signal takes {unknown} (they take {sorted(samples)})")
    return {**samples, **given}
