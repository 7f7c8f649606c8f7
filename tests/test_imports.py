"""Tests and benchmarks import only the public names of other packages: a private module (a dotted
path with a segment starting with `_`) or a private name can change in any release. torchtelemetry
and tests are ours and exempt; the few private imports with no public equivalent are allowed in one
file each, with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = frozenset({"torchtelemetry", "tests", "bench"})
ALLOWED = {
    ("tests/ops.py", "torch.utils._python_dispatch.TorchDispatchMode"): (
        "torch 2.13 has no public dispatch mode, the only way to see the aten ops a block runs "
        "(op counts, host syncs); tests/hostsync.py and bench/ import it from tests.ops"
    ),
    ("tests/trees.py", "torch.utils._pytree"): (
        "torch 2.13 has no public pytree module, and the library walks its trees with this one; "
        "tests import it from tests.trees"
    ),
    ("tests/collect/test_collector.py", "torch.distributed.distributed_c10d._world"): (
        "no public count of the live process groups (dist.get_pg_count() counts those ever "
        "created), which the test of unbinding needs to see a group given back"
    ),
    ("tests/report/test_layers_signal.py", "torch.optim.optimizer._global_optimizer_pre_hooks"): (
        "no public listing of the optimizer step pre-hooks registered for every optimizer "
        "(register_optimizer_step_pre_hook returns only a handle), which the test needs to see "
        "close() remove the one watch_layers added"
    ),
}
"""(file, imported path): why no public name does."""


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.endswith("__") for part in path.split("."))


def private_imports(root: Path, folders: tuple[str, ...] = ("tests", "bench")) -> set[tuple[str, str]]:
    """Each (file, dotted path) under `folders` of `root` that imports a private module or name of a
    package other than ours."""
    found: set[tuple[str, str]] = set()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=name)):
                if isinstance(node, ast.Import):
                    paths = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    paths = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                found.update(
                    (name, dotted)
                    for dotted in paths
                    if dotted.split(".")[0] not in OURS and _private(dotted)
                )
    return found


def test_tests_and_benchmarks_import_only_public_names_of_other_packages() -> None:
    found = private_imports(ROOT)
    assert sorted(found - ALLOWED.keys()) == [], (
        "private imports of other packages: use their public names, or where there is none add "
        "(file, path) to ALLOWED in tests/test_imports.py with the reason"
    )
    assert ALLOWED.keys() <= found, "an allowed private import is gone: remove it from ALLOWED"


def test_the_rule_finds_private_modules_and_names_wherever_imported(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_scratch.py").write_text(
        "from __future__ import annotations\n"
        "import torch._dynamo\n"
        "from torch.utils import _pytree\n"
        "from torch.overrides import TorchFunctionMode\n"
        "from torchtelemetry.report._values import ReportValue\n"
        "from tests.report.windows import context\n\n\n"
        "def test_something():\n"
        "    from opentelemetry.semconv._incubating.attributes import process_attributes\n"
    )

    assert private_imports(tmp_path, ("tests",)) == {
        ("tests/test_scratch.py", "torch._dynamo"),
        ("tests/test_scratch.py", "torch.utils._pytree"),
        ("tests/test_scratch.py", "opentelemetry.semconv._incubating.attributes.process_attributes"),
    }
