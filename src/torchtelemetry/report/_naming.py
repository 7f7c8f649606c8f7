"""The rules of a metric path, the name a value has from collection to export.

A metric path is slash-separated (`train/loss`): segments of letters, digits, '_', '.' and '-', at
most `MAX_NAME_LENGTH` characters. Checks run as soon as the metric tree is known. How each backend
spells a path (Prometheus, OpenTelemetry, the experiment trackers) is the exporters' rule and lives
beside them, in `torchtelemetry.export`.
"""

from __future__ import annotations

import re

__all__ = [
    "MAX_NAME_LENGTH",
    "InvalidMetricNameError",
    "NameCollisionError",
    "path_segment",
    "sanitize_path",
    "validate_path",
]

MAX_NAME_LENGTH = 200
"""Longest metric path accepted (backends truncate or reject longer names)."""

_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_PATH_ILLEGAL = re.compile(r"[^A-Za-z0-9_.\-]+")


class InvalidMetricNameError(ValueError):
    """A metric path that no backend can carry."""


class NameCollisionError(ValueError):
    """Two metric paths map to one backend name."""


def validate_path(name: str) -> str:
    """Return `name` if it is a legal metric path, else raise `InvalidMetricNameError`."""
    if not isinstance(name, str) or not name:
        raise InvalidMetricNameError(f"metric name {name!r}: must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidMetricNameError(
            f"metric name {name[:40]!r}...: {len(name)} characters, at most {MAX_NAME_LENGTH} allowed"
        )
    for segment in name.split("/"):
        if not _SEGMENT.match(segment):
            raise InvalidMetricNameError(
                f"metric name {name!r}: segment {segment!r} must be non-empty and use only letters, "
                "digits, '_', '.', '-' (segments are separated by '/')"
            )
    return name


def path_segment(text: str) -> str:
    """`text` with each run of characters a path segment cannot hold replaced by '_' (`a/b c` -> `a_b_c`)."""
    return _PATH_ILLEGAL.sub("_", text)


def sanitize_path(name: str) -> str:
    """A legal metric path from a framework's free-form key, or `InvalidMetricNameError`.

    `mfu(%)` -> `mfu_pct`, `memory/max_active(GiB)` -> `memory/max_active_GiB`.
    """
    segments = (path_segment(segment.replace("%", "pct")).strip("_") for segment in name.split("/"))
    return validate_path("/".join(segment for segment in segments if segment))
