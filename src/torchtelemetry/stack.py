"""`torchtelemetry stack`: the telemetry stack's files, written from the installed package.

The package ships the repository's `docker-compose.yml`, `exporters/` (Prometheus configs, alert
rules and their promtool tests, the OpenTelemetry Collector config, Grafana provisioning) and
`dashboards/` as package data: `stack-files/` in the source tree links to them, and building the
wheel or the sdist copies them in, so there is one copy of each in the repository. `write_stack`
writes them into a directory with the repository's layout, so that the commands of docs/stack.md
run from there (`docker compose up -d`, `promtool test rules exporters/prometheus/alerts_test.yml`).

Every Prometheus config written (a file with `scrape_configs`: for Docker, for a Prometheus on the
host, any other shipped later) gets its scrape targets on this machine set to where the trainer,
the Pushgateway and the Collector run. The compose stack's own services stay as they are.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["COLLECTOR_PORT", "METRICS_PORT", "PUSHGATEWAY_PORT", "main", "stack_files", "write_stack"]

METRICS_PORT = 9464
"""The trainer's scrape port in the shipped configs (`PrometheusExporter`'s default)."""
PUSHGATEWAY_PORT = 9091
"""The Pushgateway's port in the shipped configs."""
COLLECTOR_PORT = 8889
"""The port of the Collector's Prometheus exposition in the shipped configs."""

_THIS_MACHINE = frozenset({"127.0.0.1", "localhost", "host.docker.internal"})
"""Target hosts that mean "the machine Prometheus or Docker runs on": the targets a flag moves."""
_NOT_SHIPPED = (".py", ".pyc")
"""Suffixes left out of the package (dashboards/generate.py): pyproject's exclude-package-data."""

_PROMETHEUS_CONFIG = re.compile(r"^scrape_configs:", re.MULTILINE)
_TARGETS_KEY = re.compile(r"^(?P<indent>[ \t]*(?:-[ \t]+)?)targets:(?P<value>.*)$")
_BLOCK_ITEM = re.compile(r"^(?P<indent>[ \t]*)-[ \t]")
_TARGET = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})\b")
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+")


def _files() -> Traversable:
    return files("torchtelemetry") / "stack-files"


def stack_files() -> Iterator[tuple[str, Traversable]]:
    """(path relative to the stack's root, file) of every file the package ships, sorted by path."""

    def walk(directory: Traversable, prefix: str) -> Iterator[tuple[str, Traversable]]:
        for entry in sorted(directory.iterdir(), key=lambda entry: entry.name):
            if entry.name.startswith(".") or entry.name == "__pycache__":
                continue
            if entry.is_dir():
                yield from walk(entry, f"{prefix}{entry.name}/")
            elif not entry.name.endswith(_NOT_SHIPPED):
                yield f"{prefix}{entry.name}", entry

    return walk(_files(), "")


def _address(value: str, key: str) -> str:
    """`HOST:PORT` from `HOST:PORT` or `http://HOST:PORT` (as given to `PushgatewayExporter`)."""
    address = value.removeprefix("http://").removesuffix("/")
    match = _TARGET.fullmatch(address)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{key}: expected HOST:PORT or http://HOST:PORT, got {value!r}")
    return address


def _targets_rewriter(
    *, metrics_host: str | None, metrics_port: int, pushgateway: str | None, collector: str | None
) -> tuple[Callable[[str], str], set[int]]:
    """A function that moves one `HOST:PORT` target on this machine to where its service runs,
    and the set of default ports it has moved so far."""
    moved: set[int] = set()
    routes = {
        METRICS_PORT: lambda host: f"{metrics_host or host}:{metrics_port}",
        PUSHGATEWAY_PORT: lambda host: pushgateway or f"{host}:{PUSHGATEWAY_PORT}",
        COLLECTOR_PORT: lambda host: collector or f"{host}:{COLLECTOR_PORT}",
    }

    def rewrite(target: str) -> str:
        def replace(match: re.Match[str]) -> str:
            port = int(match["port"])
            if match["host"] not in _THIS_MACHINE or port not in routes:
                return match[0]
            moved.add(port)
            return routes[port](match["host"])

        return _TARGET.sub(replace, target)

    return rewrite, moved


def _rewrite_scrape_targets(text: str, rewrite: Callable[[str], str]) -> str:
    """`text` with `rewrite` applied to the value of every `targets:` key, in flow style
    (`targets: ["a:1", "b:2"]`, on one line or several) or block style (one `- a:1` a line)."""
    out: list[str] = []
    block_column: int | None = None  # in a block list of targets: the column of its key
    in_flow = False  # in a flow list of targets that goes on over several lines
    for line in text.splitlines(keepends=True):
        if in_flow:
            out.append(rewrite(line))
            in_flow = "]" not in line.split("#", 1)[0]
            continue
        item = _BLOCK_ITEM.match(line)
        if block_column is not None and item is not None and len(item["indent"]) >= block_column:
            out.append(rewrite(line))
            continue
        block_column = None
        key = _TARGETS_KEY.match(line)
        if key is None:
            out.append(line)
            continue
        value = key["value"].split("#", 1)[0].strip()
        block_column = None if value else len(key["indent"])
        in_flow = value.startswith("[") and "]" not in value
        out.append(line[: key.start("value")] + rewrite(key["value"]) + line[key.end("value") :])
    return "".join(out)


def write_stack(
    out: str | Path,
    *,
    metrics_host: str | None = None,
    metrics_port: int = METRICS_PORT,
    pushgateway: str | None = None,
    collector: str | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the telemetry stack shipped in the package into `out`; return the files written.

    `out` gets the repository's layout: `docker-compose.yml`, `exporters/`, `dashboards/`. In
    every Prometheus config, the scrape targets on this machine move to where things run:
    the trainer's (`PrometheusExporter`) to `metrics_host` (default: unchanged, the host seen from
    Docker or 127.0.0.1) and `metrics_port`; the Pushgateway's and the Collector's that a
    Prometheus outside Docker scrapes to `pushgateway` and `collector` (`HOST:PORT`, or
    `http://HOST:PORT`). Raises `FileExistsError` before writing anything if a file is there
    already, unless `overwrite`, and `ValueError` for an address that no shipped config uses, for
    an `out` that is not a directory, and for a symbolic link inside `out` on the way to a file
    (a dangling one included): nothing is ever written outside `out`.
    """
    if not 0 < metrics_port < 65536:
        raise ValueError(f"metrics_port: must be in 1..65535, got {metrics_port}")
    if metrics_host is not None and not _HOST.fullmatch(metrics_host):
        raise ValueError(f"metrics_host: expected a host name or an IP address, got {metrics_host!r}")
    pushgateway = None if pushgateway is None else _address(pushgateway, "pushgateway")
    collector = None if collector is None else _address(collector, "collector")
    rewrite, moved = _targets_rewriter(
        metrics_host=metrics_host, metrics_port=metrics_port, pushgateway=pushgateway, collector=collector
    )
    contents: dict[str, bytes] = {}
    for name, source in stack_files():
        data = source.read_bytes()
        if name.endswith((".yml", ".yaml")) and _PROMETHEUS_CONFIG.search(text := data.decode()):
            data = _rewrite_scrape_targets(text, rewrite).encode()
        contents[name] = data
    asked = {
        METRICS_PORT: ("metrics_host", metrics_host is not None or metrics_port != METRICS_PORT),
        PUSHGATEWAY_PORT: ("pushgateway", pushgateway is not None),
        COLLECTOR_PORT: ("collector", collector is not None),
    }
    for port, (key, given) in asked.items():
        if given and port not in moved:
            raise ValueError(
                f"{key}: no Prometheus config in the package scrapes a target on this machine's "
                f"port {port}, so there is nothing to set; edit the written configs instead"
            )
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise ValueError(f"out: {root} is not a directory; name a directory to write into")
    links = sorted({str(link) for name in contents for link in _links_on_the_way(root, name)})
    if links:
        raise ValueError(
            f"out: {root} holds symbolic links the stack would be written through ({', '.join(links)}); "
            "nothing is written outside the directory, even with --force: remove them or write elsewhere"
        )
    present = [name for name in contents if (root / name).exists()]
    if present and not overwrite:
        raise FileExistsError(
            f"{root} already holds {', '.join(present)}: write elsewhere or overwrite them (--force)"
        )
    written = []
    for name, data in contents.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def _links_on_the_way(root: Path, name: str) -> Iterator[Path]:
    """The symbolic links (dangling ones too) among the paths below `root` that lead to `root / name`."""
    path = root
    for part in Path(name).parts:
        path = path / part
        if path.is_symlink():
            yield path


def main(argv: Sequence[str] | None = None) -> int:
    """`torchtelemetry stack --out DIR [...]`."""
    parser = argparse.ArgumentParser(
        prog="torchtelemetry stack",
        description=(
            "Write the telemetry stack (docker-compose.yml; exporters/: Prometheus configs for "
            "Docker and for a Prometheus on the host, alert rules and their promtool tests, the "
            "OpenTelemetry Collector config, Grafana provisioning; dashboards/) from the installed "
            "package into DIR, with the repository's layout: `cd DIR && docker compose up -d`."
        ),
    )
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to write into")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        metavar="PORT",
        help=f"port of the trainer's PrometheusExporter (default {METRICS_PORT})",
    )
    parser.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="host of rank 0's PrometheusExporter (default: the Docker host, or 127.0.0.1 outside Docker)",
    )
    parser.add_argument(
        "--pushgateway",
        metavar="HOST:PORT",
        help=f"the Pushgateway a Prometheus outside Docker scrapes (default 127.0.0.1:{PUSHGATEWAY_PORT})",
    )
    parser.add_argument(
        "--collector",
        metavar="HOST:PORT",
        help="the OpenTelemetry Collector's Prometheus exposition a Prometheus outside Docker scrapes "
        f"(default 127.0.0.1:{COLLECTOR_PORT})",
    )
    parser.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    args = parser.parse_args(argv)
    try:
        written = write_stack(
            args.out,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            pushgateway=args.pushgateway,
            collector=args.collector,
            overwrite=args.force,
        )
    except (ValueError, OSError) as error:  # a usage error, or a DIR that cannot be written: one line
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for path in written:
        print(path)
    print(f"torchtelemetry stack: wrote {len(written)} files; next: cd {args.out} && docker compose up -d")
    return 0


if __name__ == "__main__":
    sys.exit(main())
