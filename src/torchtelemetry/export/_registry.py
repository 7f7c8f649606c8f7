"""Exporters by name, through the `torchtelemetry.exporters` entry-point group.

Third-party packages add exporters by declaring an entry point in that group
(`myexporter = "mypkg:MyExporter"`); configuration then names them, as in
`exporters_from_spec("prometheus,jsonl", prometheus={"port": 0})`.
"""

from __future__ import annotations

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


def exporters_from_spec(spec: str | Iterable[str], **options_by_name: Mapping[str, Any]) -> list[Exporter]:
    """Build the exporters named in `spec` ("prometheus,jsonl" or a list), in order.

    `options_by_name[name]` holds the keyword arguments of that exporter
    (e.g. `prometheus={"port": 0}`); options for a known exporter not in the
    spec are ignored, options for an unknown name are an error.
    """
    names = (
        [part.strip() for part in spec.split(",")]
        if isinstance(spec, str)
        else [str(n).strip() for n in spec]
    )
    names = [name for name in names if name]
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
    for name in names:
        factory = exporter_class(name)
        options = dict(options_by_name.get(name, {}))
        try:
            exporters.append(factory(**options))
        except TypeError as error:
            raise TypeError(
                f"exporters_from_spec: exporter {name!r} with options {options}: {error}"
            ) from error
    return exporters
