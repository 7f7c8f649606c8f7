"""The demo's command line, generated from `DemoConfig`: one flag per field, so no default is written twice.

`--batch-size 8` sets `batch_size`; booleans get `--console/--no-console`; an optional field
takes `none`; every exporter flag takes `""` for its exporter's default destination (the epilog
says so); a field with an environment variable in its metadata reads its default there
(argument > environment variable > field default). Help text is the field's docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchtelemetry.demo._config import DemoConfig

__all__ = ["build_parser", "parse_args"]


def build_parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """An `argparse` parser with one flag per `DemoConfig` field."""
    parser = argparse.ArgumentParser(
        prog="torchtelemetry demo",
        description="A real multi-process training run (tiny transformer, synthetic data) wired to every "
        "exporter; spawns --nproc ranks itself, or runs unchanged under torchrun.",
        epilog="Exporter flags (--pushgateway, --otlp, --wandb, --tensorboard, --mlflow, --jsonl): a "
        'destination turns the exporter on there, "" turns it on at its default destination, none '
        "leaves it off.",
    )
    hints = typing.get_type_hints(DemoConfig)
    docs = _field_docs(DemoConfig)
    for field in dataclasses.fields(DemoConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = docs.get(field.name, "").replace("%", "%%")
        default = field.default
        env_name = field.metadata.get("env")
        if env_name is not None:
            help_text += f" [${env_name}]"
            default = env.get(env_name, default)  # a string: argparse converts it with `type`
        kind, optional = _unwrap(hints[field.name])
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        shown = '""' if default == "" else "%(default)s"
        parser.add_argument(
            flag,
            type=_converter(kind, optional),
            default=default,
            metavar=kind.__name__.upper() + ("|none" if optional else ""),
            help=f"{help_text} (default: {shown})",
        )
    return parser


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] = os.environ) -> DemoConfig:
    """The `DemoConfig` of a command line; invalid values exit with the field's error."""
    parser = build_parser(env)
    values = vars(parser.parse_args(argv))
    if values["otlp"] is None and (
        env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        values["otlp"] = ""  # configured by the OTEL_* variables: the exporter reads them
    try:
        return DemoConfig(**values)
    except ValueError as error:
        parser.error(str(error))


def _unwrap(hint: Any) -> tuple[type, bool]:
    """`int | None` -> (int, True); `int` -> (int, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"DemoConfig: cannot make a flag of {hint!r}")
        return kinds[0], True
    return hint, False


def _converter(kind: type, optional: bool) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        return kind(text)

    convert.__name__ = kind.__name__  # argparse names the type in its error messages
    return convert


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right after it in the class body)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return {}
    return {
        node.target.id: " ".join(after.value.value.split())
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
    }
