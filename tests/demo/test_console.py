"""The demo's progress bar: lines written to stderr while it is shown (the window lines `Telemetry`
prints, warnings) go above it, each on a terminal line of its own, and the bar is closed after."""

from __future__ import annotations

import re
import sys
import threading

import pytest

from torchtelemetry.demo import DemoConfig
from torchtelemetry.demo._console import above_the_bar, progress_bar

LINE = "torchtelemetry: step 9 | train/loss 3.872 | 9.61k tokens/s | ok"


def test_a_line_written_while_the_bar_is_shown_starts_a_terminal_line_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stream = sys.stderr
    progress = progress_bar(DemoConfig(steps=10), enabled=True)
    with above_the_bar(progress):
        progress.update(3)
        progress.refresh()
        writer = threading.Thread(target=lambda: print(LINE, file=sys.stderr, flush=True))  # the collector
        writer.start()
        writer.join()
        progress.update(1)
    err = capsys.readouterr().err
    (at,) = [match.start() for match in re.finditer(re.escape(LINE), err)]
    assert err[at - 1] in "\r\n", f"the line shares a terminal line with the bar: {err!r}"
    assert err[at + len(LINE)] == "\n"
    assert "4/10" in err[at:], "the bar is drawn again below the line"
    assert sys.stderr is stream, "stderr is restored"
    assert progress.disable, "the bar is closed"


def test_without_a_bar_stderr_is_left_alone(capsys: pytest.CaptureFixture[str]) -> None:
    stream = sys.stderr
    with above_the_bar(progress_bar(DemoConfig(), enabled=False)):
        assert sys.stderr is stream
        print(LINE, file=sys.stderr)
    assert capsys.readouterr().err == LINE + "\n"
