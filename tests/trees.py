"""torch's pytree, the one the library's trees of metrics and results are walked with.

The one import of `torch.utils._pytree` in tests/ (tests/test_imports.py allows it here alone):
torch 2.13 has no public pytree module, and a test must walk a tree as the library does
(src/torchtelemetry imports the same module).
"""

from __future__ import annotations

from torch.utils import _pytree as pytree

__all__ = ["pytree"]
