"""`redact_url`: the one way a URL reaches a log line, an error message or a repr.

An exporter's address may carry secrets in two places: the user information
(`https://user:password@host`) and the query string (`...?api_key=SECRET`, as some OTLP
vendors take their token). Every URL an exporter logs, raises or shows goes through
`redact_url`, which masks both and keeps what tells a reader where the reports go: the
scheme, the host, the port, the path and the names of the query parameters.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

__all__ = ["MASK", "has_user_info", "redact_url"]

MASK = "***"
"""What a secret part of a URL reads as in logs."""


def has_user_info(url: str) -> bool:
    """Whether `url` carries `user:password@`."""
    return "@" in _split(url).netloc


def redact_url(url: str) -> str:
    """`url` safe for logs: `user:password@` reads `***@`, each query value (and a fragment) `***`.

    `https://u:p@host:4318/v1/metrics?api_key=SECRET&tenant=a` becomes
    `https://***@host:4318/v1/metrics?api_key=***&tenant=***`; a query item without `=` is
    masked whole. A URL without a scheme (`host:4317`) keeps its form.
    """
    rest, hash_sign, fragment = url.partition("#")
    rest, question_mark, query = rest.partition("?")
    netloc = _split(rest).netloc
    if "@" in netloc:
        rest = rest.replace(netloc, f"{MASK}@{netloc.rpartition('@')[2]}", 1)
    if query:
        query = "&".join(
            f"{name}={MASK}" if separator else MASK
            for name, separator, _ in (item.partition("=") for item in query.split("&"))
        )
    return f"{rest}{question_mark}{query}{hash_sign}{MASK if fragment else ''}"


def _split(url: str) -> SplitResult:
    return urlsplit(url if "//" in url else f"//{url}")
