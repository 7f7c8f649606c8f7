"""The `torchtelemetry` command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torchtelemetry._version import __version__

__all__ = ["main"]

_USAGE = """usage: torchtelemetry <command> [options]
       torchtelemetry --version

commands:
  demo     a real multi-process training run exporting live metrics (torchtelemetry demo --help)
  stack    write Prometheus, alert rules, Grafana dashboards, Collector and compose files into a
           directory, ready for `docker compose up -d` (torchtelemetry stack --help)
  signals  print the signal registry (every name exported by default, as each backend spells it)
           as JSON, or write it with --output PATH (exporters/signals.json is its output)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch `torchtelemetry <command>`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command in ("-V", "--version"):
        print(f"torchtelemetry {__version__}")
        return 0
    if command == "demo":
        from torchtelemetry.demo import main as demo_main

        return demo_main(rest)
    if command == "stack":
        from torchtelemetry.stack import main as stack_main

        return stack_main(rest)
    if command == "signals":
        return _signals(rest)
    print(f"torchtelemetry: unknown command {command!r}\n{_USAGE}", end="", file=sys.stderr)
    return 2


def _signals(argv: Sequence[str]) -> int:
    import argparse
    from pathlib import Path

    from torchtelemetry.export import render_signal_registry

    parser = argparse.ArgumentParser(
        prog="torchtelemetry signals",
        description="The signal registry: every name exported by default, as each backend spells it.",
    )
    parser.add_argument("--output", type=Path, help="write it to this file instead of standard output")
    args = parser.parse_args(argv)
    text = render_signal_registry()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
