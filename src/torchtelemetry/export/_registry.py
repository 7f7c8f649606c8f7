"""Exporters by name, through the `torchtelemetry.exporters` entry-point group.

Third-party packages add exporters by declaring an entry point in that group
(`myexporter = "mypkg:MyExporter"`); configuration then names them, with their options in the
string (`"prometheus(port=9464), jsonl(path='metrics.jsonl')"`, what a command-line flag or a
config file can hold) or as keyword arguments (`exporters_from_spec("prometheus", prometheus={"port": 0})`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from torchtelemetry.export._protocol import Exporter

__all__ = ["ENTRY_POINT_GROUP", "available_exporters", "exporter_class", "exporters_from_spec"]

ENTRY_POINT_GROUP = "torchtelemetry.exporters"
"""Entry-point group naming exporter classes (or factories)."""


def available_exporters() -> dict[str, EntryPoint]:
    """Every exporter name declared in the entry-point group, sorted by name."""
    found = entry_points(group=ENTRY_POINT_GROUP)
    return {entry.name: entry for entry in sorted(found, key=lambda entry: entry.name)}


def exporter_class(name: str) -> Any:
    """Load the class (or factory) registered as `name`; a clear error if unknown or not importable."""
    known = available_exporters()
    if name not in known:
        raise ValueError(
            f"exporter {name!r}: unknown; known exporters are {', '.join(known) or '(none)'} "
            f"(packages add more through the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    try:
        return known[name].load()
    except (ImportError, AttributeError) as error:
        raise ImportError(f"exporter {name!r} ({known[name].value}) could not be loaded: {error}") from error


def _parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """`"prometheus(port=9464), jsonl"` as [(name, options)]: names, each optionally called with
    keyword arguments whose values are Python literals (numbers, strings, booleans, None, lists)."""
    if "(" not in spec:  # names only, whatever characters an entry point's name holds
        return [(name, {}) for name in (part.strip() for part in spec.split(",")) if name]
    usage = (
        f"exporters_from_spec: cannot read {spec!r}; write exporter names separated by commas, each "
        "optionally with keyword options of literal values: \"prometheus(port=9464), jsonl(path='m.jsonl')\""
    )
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as error:
        raise ValueError(usage) from error
    parsed = []
    for item in tree.elts if isinstance(tree, ast.Tuple) else [tree]:
        if isinstance(item, ast.Name):
            parsed.append((item.id, {}))
            continue
        if not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args:
            raise ValueError(f"{usage} (not an exporter name or name(key=value, ...): {ast.unparse(item)!r})")
        options = {}
        for keyword in item.keywords:
            try:
                options[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError as error:
                raise ValueError(
                    f"{usage} (option {keyword.arg}={ast.unparse(keyword.value)} of {item.func.id!r} is not "
                    "a literal: quote strings)"
                ) from error
        if None in options:
            raise ValueError(f"{usage} (**options of {item.func.id!r})")
        parsed.append((item.func.id, options))
    return parsed


def exporters_from_spec(spec: str | Iterable[str], **options_by_name: Mapping[str, Any]) -> list[Exporter]:
    """Build the exporters named in `spec`, in order: `"prometheus, jsonl"`, a list of names, or with
    options in the string, `"prometheus(port=9464), jsonl(path='metrics.jsonl')"`.

    `options_by_name[name]` holds more keyword arguments of that exporter
    (e.g. `prometheus={"port": 0}`; an option given both ways is an error); options for a known
    exporter not in the spec are ignored, options for an unknown name are an error.
    """
    parsed = (
        _parse_spec(spec)
        if isinstance(spec, str)
        else [(name, {}) for name in (str(n).strip() for n in spec) if name]
    )
    names = [name for name, _ in parsed]
    known = available_exporters()
    unknown = sorted({*names, *options_by_name} - set(known))
    if unknown:
        raise ValueError(
            f"exporters_from_spec: unknown exporter(s) {unknown} in {spec!r}; "
            f"known exporters are {', '.join(known) or '(none)'}"
        )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"exporters_from_spec: {duplicates} named more than once in {spec!r}")
    exporters = []
    for name, given in parsed:
        factory = exporter_class(name)
        extra = dict(options_by_name.get(name, {}))
        twice = sorted(set(given) & set(extra))
        if twice:
            raise ValueError(
                f"exporters_from_spec: exporter {name!r} has {twice} in {spec!r} and as arguments"
            )
        options = {**given, **extra}
        try:
            exporters.append(factory(**options))
        except TypeError as error:
            raise TypeError(
                f"exporters_from_spec: exporter {name!r} with options {options}: {error}"
            ) from error
    return exporters
