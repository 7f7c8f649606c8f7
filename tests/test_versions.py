"""The declared floors (pyproject.toml) hold for what CPU can check: CI installs one torch (2.13.0)
and one Python (3.11), so the code is kept to the floors' APIs where a newer one would creep in.

- Python >= 3.11: every module parses as 3.11 syntax (`BaseException.add_note` is why it is 3.11).
- torch >= 2.5: `torch.distributed.tensor` (DTensor, Shard) is public from 2.5; the one TreeSpec
  walk of the library runs against a TreeSpec with 2.5's interface only (`children()` is 2.10's).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.trees import pytree
from torchtelemetry.collect._results import _built, _structure

ROOT = Path(__file__).resolve().parents[1]


def _declared() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_module_parses_as_the_declared_python_floor() -> None:
    floor = re.fullmatch(r">=3\.(\d+)", _declared()["requires-python"])
    assert floor, "requires-python must be a floor, >=3.N"
    for path in sorted((ROOT / "src").rglob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, int(floor[1])))


def test_the_torch_floor_is_where_the_public_dtensor_module_appeared() -> None:
    assert "torch>=2.5" in _declared()["dependencies"]
    sources = "\n".join(path.read_text() for path in (ROOT / "src").rglob("*.py"))
    assert "torch.distributed._tensor" not in sources  # the pre-2.5 private path is not needed


class TreeSpec25:
    """What the library may read of a `torch.utils._pytree.TreeSpec`: what torch 2.5 has and torch 2.13
    has not deprecated (`children_specs` is deprecated; `children()` is 2.10's)."""

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.type = spec.type
        self.context = spec.context
        self.num_nodes, self.num_leaves = spec.num_nodes, spec.num_leaves
        self.num_children = spec.num_children
        self._is_leaf = spec.is_leaf()

    def is_leaf(self) -> bool:
        return self._is_leaf


@pytest.mark.parametrize(
    ("tree", "leaves"),
    [(1.0, [1.0]), ({"a": 1, "b": 2}, [1, 2]), ({"macro_f1": 0.5, "f1": [0.1, 0.9]}, None)],
)
def test_results_are_built_with_the_treespec_api_of_the_torch_floor(tree: Any, leaves: list | None) -> None:
    structure = _structure(TreeSpec25(pytree.tree_structure(tree)))  # type: ignore[arg-type]
    if leaves is not None:  # the fast paths: a leaf, a dict of leaves
        assert _built(structure, leaves) == tree
