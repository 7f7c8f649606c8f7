"""torchtelemetry: GPU-resident PyTorch training metrics, synced across ranks, exported from rank 0.

The top level holds what a training script uses; the building blocks live in their subpackages,
each importing only those before it (.importlinter): `torchtelemetry.sync` (collectives over packed
tensors, functional reductions), `torchtelemetry.metric` (metrics, `sync_metrics`),
`torchtelemetry.collect` (windows collected off the training loop), `torchtelemetry.report` (named
values, naming rules), `torchtelemetry.export` (the `Exporter` protocol, the hub, the backends),
`Telemetry`, and `torchtelemetry.integrations` (framework adapters).

The top-level names are imported on first use (PEP 562), so that the command line
(`torchtelemetry --version`) answers without importing torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from torchtelemetry._version import __version__

if TYPE_CHECKING:
    from torchtelemetry.collect import AsyncMetricCollector, CollectionError, sync_and_compute
    from torchtelemetry.config import TelemetryConfig
    from torchtelemetry.export import (
        ConsoleExporter,
        JsonlExporter,
        MLflowExporter,
        OTelExporter,
        PrometheusExporter,
        PushgatewayExporter,
        TensorBoardExporter,
        WandbExporter,
    )
    from torchtelemetry.metric import (
        AccuracyMetric,
        BinaryAUROCMetric,
        ConfusionMatrixMetric,
        HistogramMetric,
        MaxMetric,
        Metric,
        MetricAccumulator,
        MinMetric,
        PerRankMetric,
        SumMetric,
        WeightedMeanMetric,
        sync_metrics,
    )
    from torchtelemetry.stop import StopOnSignal
    from torchtelemetry.telemetry import RunIdentity, Telemetry, TelemetryStartupError

__all__ = [
    "AccuracyMetric",
    "AsyncMetricCollector",
    "BinaryAUROCMetric",
    "CollectionError",
    "ConfusionMatrixMetric",
    "ConsoleExporter",
    "HistogramMetric",
    "JsonlExporter",
    "MLflowExporter",
    "MaxMetric",
    "Metric",
    "MetricAccumulator",
    "MinMetric",
    "OTelExporter",
    "PerRankMetric",
    "PrometheusExporter",
    "PushgatewayExporter",
    "RunIdentity",
    "StopOnSignal",
    "SumMetric",
    "Telemetry",
    "TelemetryConfig",
    "TelemetryStartupError",
    "TensorBoardExporter",
    "WandbExporter",
    "WeightedMeanMetric",
    "__version__",
    "sync_and_compute",
    "sync_metrics",
]


def __getattr__(name: str) -> Any:
    """A public name (imports every public name at once), or a subpackage (imports it)."""
    if name in __all__:
        from torchtelemetry import _public

        globals().update({key: getattr(_public, key) for key in __all__ if key != "__version__"})
        return globals()[name]
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
