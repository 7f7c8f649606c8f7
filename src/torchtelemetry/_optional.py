"""Optional dependencies: imported when first used, with an error that names the pip extra."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]


def import_optional(module: str, extra: str, needed_by: str) -> ModuleType:
    """`module`, or an ImportError saying `needed_by` needs it and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(
            f"{needed_by} needs {package}, which is not installed: pip install 'torchtelemetry[{extra}]' "
            f"({error})"
        ) from error
