"""Adapters for training frameworks, each behind its own extra and imported only when used.

```python
from torchtelemetry.integrations import LightningTelemetryCallback  # imports lightning now
```

| framework | adapter | extra |
| --- | --- | --- |
| Lightning | `LightningTelemetryCallback`, `LightningTelemetryLogger` | `lightning` |
| Hugging Face `Trainer` | `TrainerTelemetryCallback` | `transformers` |
| accelerate | `TelemetryTracker` | `accelerate` |
| torchtitan-style loops | `TelemetryMetricLogger` | none |
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "LightningTelemetryCallback",
    "LightningTelemetryLogger",
    "TelemetryMetricLogger",
    "TelemetryTracker",
    "TrainerTelemetryCallback",
]

_MODULES = {
    "LightningTelemetryCallback": "_lightning",
    "LightningTelemetryLogger": "_lightning",
    "TelemetryMetricLogger": "_metric_logger",
    "TelemetryTracker": "_accelerate",
    "TrainerTelemetryCallback": "_transformers",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
