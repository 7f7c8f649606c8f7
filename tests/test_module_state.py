"""No process-global state without a reason: each module-level value of the package that holds state
(a lock, a counter, a cache, a container the package mutates, a name rebound through `global`) says
why it must be one per process in a `# Process-global: <why>` comment on the line above it. The rest
is per object. A constant table the package never mutates is not state."""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import itertools
import pkgutil
import threading
import weakref
from pathlib import Path
from types import ModuleType

import pytest

import torchtelemetry

MARK = "# Process-global:"
MUTATORS = frozenset(
    {
        "add",
        "append",
        "appendleft",
        "clear",
        "difference_update",
        "discard",
        "extend",
        "extendleft",
        "insert",
        "intersection_update",
        "move_to_end",
        "pop",
        "popitem",
        "remove",
        "reverse",
        "setdefault",
        "sort",
        "symmetric_difference_update",
        "update",
    }
)
"""The methods of dict, list, set, deque and OrderedDict that change them in place."""
CONTAINERS = (dict, list, set, bytearray)
"""State when the package mutates them, constants otherwise."""
STATEFUL = (
    collections.deque,
    collections.OrderedDict,
    itertools.count,
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Event,
    threading.Semaphore,
    weakref.WeakKeyDictionary,
    weakref.WeakSet,
    weakref.WeakValueDictionary,
)
"""State whatever the package does with them."""


def _modules(package: ModuleType) -> list[ModuleType]:
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        found.append(importlib.import_module(info.name))
    return found


def _changed(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The bare names that `tree` mutates in place (item assignment or deletion, a mutating method
    call), and those it rebinds through a `global` statement."""
    mutated: set[str] = set()
    rebound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            rebound.update(node.names)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            if isinstance(node.value, ast.Name):
                mutated.add(node.value.id)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(node.func.value, ast.Name)
        ):
            mutated.add(node.func.value.id)
    return mutated, rebound


def _defined_at(tree: ast.Module) -> dict[str, int]:
    """Each name the module's own top level binds (re-exports excluded), with the first line of its
    statement (decorators included)."""
    lines: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and node.value is not None and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        elif isinstance(node, ast.FunctionDef):
            targets = [node.name]
        else:
            continue
        first = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
        lines.update({name: first for name in targets})
    return lines


def process_globals(package: ModuleType) -> dict[str, str | None]:
    """Each module-level name of `package` that holds state, as `module.name`: its reason, or None
    where the line above it gives none."""
    modules = _modules(package)
    sources = {module.__name__: inspect.getsource(module) for module in modules}
    trees = {name: ast.parse(source) for name, source in sources.items()}
    mutated: set[int] = set()  # ids of the objects mutated, whichever module names them
    rebound: set[tuple[str, str]] = set()
    for module in modules:
        names, globals_ = _changed(trees[module.__name__])
        mutated.update(id(getattr(module, name)) for name in names if hasattr(module, name))
        rebound.update((module.__name__, name) for name in globals_)
    found: dict[str, str | None] = {}
    for module in modules:
        lines = sources[module.__name__].splitlines()
        for name, line in _defined_at(trees[module.__name__]).items():
            value = getattr(module, name)
            if not (
                isinstance(value, STATEFUL)
                or (isinstance(value, CONTAINERS) and id(value) in mutated)
                or (module.__name__, name) in rebound
                or hasattr(value, "cache_info")  # functools.cache and lru_cache
            ):
                continue
            above = lines[line - 2].strip() if line > 1 else ""
            found[f"{module.__name__}.{name}"] = (
                above.removeprefix(MARK).strip() if above.startswith(MARK) else None
            )
    return found


def test_every_process_global_of_the_package_says_why_it_is_one() -> None:
    found = process_globals(torchtelemetry)
    without = sorted(name for name, reason in found.items() if not reason)
    assert not without, (
        f"module-level state without a reason: {without}; make it per object (an attribute of the "
        f"object that uses it), or write `{MARK} <why it must be one per process>` on the line above it"
    )
    assert "torchtelemetry.report.signals._memory_health._STATM" in found  # the rule sees the known ones


def test_the_rule_tells_state_from_constants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "scratch_state"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package with state of every kind."""\n')
    (package / "tables.py").write_text(
        "import functools\n"
        "import threading\n\n"
        "UNITS = {'s': 'seconds'}\n"
        "ORDER = ['a', 'b']\n"
        "_CACHE = {}\n"
        "_LOCK = threading.Lock()\n"
        "# Process-global: one per process by nature.\n"
        "_SEEN = []\n"
        "_COUNT = 0\n\n\n"
        "@functools.cache\n"
        "def parsed(text):\n"
        "    return text.split()\n\n\n"
        "def remember(key):\n"
        "    global _COUNT\n"
        "    _CACHE[key] = UNITS[key]\n"
        "    _SEEN.append(key)\n"
        "    _COUNT += 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    found = process_globals(importlib.import_module("scratch_state"))

    assert found == {
        "scratch_state.tables._CACHE": None,
        "scratch_state.tables._LOCK": None,
        "scratch_state.tables._SEEN": "one per process by nature.",
        "scratch_state.tables._COUNT": None,
        "scratch_state.tables.parsed": None,
    }
