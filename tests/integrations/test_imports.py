"""Importing an adapter whose framework is missing raises ImportError naming the extra to install."""

from __future__ import annotations

import importlib
import sys

import pytest

import torchtelemetry.integrations as integrations


@pytest.mark.parametrize(
    ("adapter", "framework", "extra"),
    [
        ("LightningTelemetryCallback", "lightning", "lightning"),
        ("LightningTelemetryLogger", "lightning", "lightning"),
        ("TrainerTelemetryCallback", "transformers", "transformers"),
        ("TelemetryTracker", "accelerate", "accelerate"),
    ],
)
def test_missing_framework_names_the_extra(monkeypatch, adapter: str, framework: str, extra: str) -> None:
    for name in list(sys.modules):
        if (
            name == framework
            or name.startswith(f"{framework}.")
            or name.startswith(f"{integrations.__name__}._")
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # what `import framework` sees when it is not installed

    with pytest.raises(ImportError, match=rf"needs {framework}.*pip install 'torchtelemetry\[{extra}\]'"):
        getattr(importlib.import_module(integrations.__name__), adapter)


def test_the_package_and_the_framework_free_logger_import_without_frameworks(monkeypatch) -> None:
    for framework in ("lightning", "transformers", "accelerate"):
        monkeypatch.setitem(sys.modules, framework, None)
    for name in [name for name in sys.modules if name.startswith(f"{integrations.__name__}")]:
        monkeypatch.delitem(sys.modules, name)

    package = importlib.import_module(integrations.__name__)
    assert package.TelemetryMetricLogger.__name__ == "TelemetryMetricLogger"
    assert sorted(dir(package)) == sorted(package.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        package.Nope  # noqa: B018
