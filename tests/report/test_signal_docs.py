"""docs/signals.md's tables name every series the built-in signals export, and nothing else: the
names come from the signal objects (`signal_descriptors()`), so a signal added, renamed or removed
without its table row fails here, naming the rows to write or fix."""

from __future__ import annotations

import re
from pathlib import Path

from torchtelemetry.report.signals import signal_descriptors

DOC = Path(__file__).resolve().parents[2] / "docs" / "signals.md"
STATISTICS = {"min", "median", "max", "min_rank", "max_rank"}
"""The suffixes every value per rank also takes above `max_rank_series` ranks (documented once)."""


def _rows() -> list[list[str]]:
    """The backticked tokens of each table row."""
    return [re.findall(r"`([^`]+)`", line) for line in DOC.read_text().splitlines() if line.startswith("|")]


def _pattern(token: str) -> str:
    """A documented name as a regular expression (`train/phase/<name>`: any phase)."""
    return re.escape(token.replace("<name>", "*")).replace(r"\*", "[a-z_]+")


def _documented(name: str, rows: list[list[str]]) -> bool:
    """Whether a row names `name`: in full, as its first name plus a fragment written beside it
    (`train/memory/allocated/max`, `/max_rank`; `train/phases/min`, `median`), or as a value per rank
    with one of the `STATISTICS` suffixes."""
    for tokens in rows:
        for full in (token for token in tokens if token.startswith(("train/", "hw/"))):
            if re.fullmatch(_pattern(full), name):
                return True
            parent = full.rsplit("/", 1)[0]
            for fragment in tokens:
                if fragment.startswith("/") and name in (full + fragment, parent + fragment):
                    return True
                if not fragment.startswith(("/", "train/", "hw/")) and name == f"{parent}/{fragment}":
                    return True
            if name.startswith(full + "/") and name[len(full) + 1 :] in STATISTICS:
                return True
    return False


def test_every_name_a_signal_exports_has_a_row_in_docs_signals_md() -> None:
    rows = _rows()
    missing = sorted(d.name for d in signal_descriptors() if not _documented(d.name, rows))
    assert not missing, f"add these to a table of {DOC.name}: {missing}"


def test_every_name_docs_signals_md_gives_is_one_a_signal_exports() -> None:
    names = {descriptor.name for descriptor in signal_descriptors()}
    stale = sorted(
        token
        for tokens in _rows()
        for token in tokens
        if token.startswith(("train/", "hw/"))
        and " " not in token
        and not any(re.fullmatch(_pattern(token), name) or name.startswith(token + "/") for name in names)
    )
    assert not stale, f"{DOC.name} names series no signal exports: {stale}"


def test_every_step_keyword_is_documented_where_the_built_in_signals_are() -> None:
    """README.md's "Built-in training signals" and this page's table say how each `step()` keyword
    is fed (`step(<keyword>=...)`, or several as `step(tokens=, samples=)`)."""
    import torchtelemetry as tt

    telemetry = tt.Telemetry({}, [], every=2, nvml=False)
    keywords = telemetry.step_keywords
    telemetry.close()
    readme = (DOC.parents[1] / "README.md").read_text().split("## Built-in training signals", 1)[1]
    table = DOC.read_text().split("## The built-in training signals", 1)[1]
    for page, text in (("README.md", readme.split("\n## ", 1)[0]), (DOC.name, table.split("\n## ", 1)[0])):
        missing = sorted(keyword for keyword in keywords if not re.search(rf"\b{keyword}=", text))
        assert not missing, f"{page}: give the built-in signals' table a row fed by step({missing[0]}=...)"
