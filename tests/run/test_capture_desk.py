"""Which verdicts become captures and what every rank reports of them, on synthetic verdicts and
windows: exact decisions, no clock, no process group (docs/signals.md, Captures)."""

from __future__ import annotations

import logging

import pytest

from torchtelemetry.report import CaptureOrder, CaptureOutcomes, CaptureWindow, Verdict
from torchtelemetry.run._capture_desk import CaptureDesk, CaptureLedger

STRAGGLER = ("straggler", "nonfinite", "hang")


def _orders(desk: CaptureDesk, settle: bool = True) -> list[CaptureOrder]:
    """Every order the desk sends, window after window, each settled by its ranks at once."""
    sent = []
    while (order := desk.take().order) is not None:
        sent.append(order)
        if settle:
            desk.settled(CaptureOutcomes(settled=1 if order.reference is None else 2))
    return sent


def test_a_verdict_triggers_once_until_it_clears_and_each_rank_named_is_its_own_verdict() -> None:
    desk = CaptureDesk(STRAGGLER, max_captures=8)
    windows = [
        [Verdict("straggler", 2, 1)],
        [Verdict("straggler", 2, 1)],  # the same straggler, still named: no new capture
        [Verdict("straggler", 2, 0), Verdict("straggler", 3, 0)],  # rank 3 joins it
        [],  # cleared
        [Verdict("straggler", 2, 1)],  # named again: a new verdict
        [Verdict("nonfinite", 2)],  # another verdict on the same rank
    ]
    sent, counts = [], {}
    for verdicts in windows:
        desk.judge(verdicts)
        window = desk.take()
        for label, count in window.counts.items():
            counts[label] = counts.get(label, 0) + count
        if window.order is not None:
            sent.append(window.order)
            desk.settled(CaptureOutcomes(settled=2 if window.order.reference is not None else 1))
    assert sent == [
        CaptureOrder(2, 1, "straggler", "straggler"),
        CaptureOrder(3, 0, "straggler", "straggler"),
        CaptureOrder(2, 1, "straggler", "straggler"),
        CaptureOrder(2, None, "nonfinite", "nonfinite"),
    ]
    assert counts == {"straggler": 3, "nonfinite": 1}


def test_only_the_triggers_of_capture_on_count() -> None:
    desk = CaptureDesk(("nonfinite",), max_captures=8)
    desk.judge([Verdict("straggler", 1, 0), Verdict("nonfinite", 3)])
    window = desk.take()
    assert window.order == CaptureOrder(3, None, "nonfinite", "nonfinite")
    assert window.counts == {"nonfinite": 1}
    desk.request(0, "mine")  # a request counts whatever capture_on names
    desk.settled(CaptureOutcomes(settled=1))
    assert desk.take() == CaptureWindow(CaptureOrder(0, None, "request", "mine"), {"request": 1})


def test_one_order_at_a_time_the_next_once_every_rank_named_settled_it() -> None:
    desk = CaptureDesk(STRAGGLER, max_captures=8)
    desk.judge([Verdict("straggler", 2, 1), Verdict("straggler", 3, 1)])
    assert desk.take().order == CaptureOrder(2, 1, "straggler", "straggler")
    assert desk.take().order is None  # nobody settled it yet
    desk.settled(CaptureOutcomes(settled=1))  # the rank named did; its reference not yet
    assert desk.take().order is None
    desk.settled(CaptureOutcomes(settled=1, failed=1))
    assert desk.take().order == CaptureOrder(3, 1, "straggler", "straggler")


def test_triggers_past_max_captures_are_counted_not_captured_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    desk = CaptureDesk(STRAGGLER, max_captures=2)
    with caplog.at_level(logging.WARNING):
        for rank in range(4):
            desk.request(rank, "request")
    assert [order.rank for order in _orders(desk)] == [0, 1]
    assert desk.ordered == 2
    assert [record.getMessage() for record in caplog.records] == [
        "Telemetry: the run made its max_captures=2 captures; a request naming rank 2 and later triggers "
        "are counted in train/capture/count, not captured (logged once)"
    ]
    restarted = CaptureDesk(STRAGGLER, max_captures=2)
    restarted.load_state_dict(desk.state_dict())  # the bound is the run's, across restarts
    restarted.request(0, "request")
    assert _orders(restarted) == []


def test_a_hang_capture_is_counted_once_and_carried_once() -> None:
    desk = CaptureDesk(STRAGGLER, max_captures=8)
    assert desk.hang_captured(2, 40) and not desk.hang_captured(2, 40)
    assert desk.take() == CaptureWindow(None, {"hang": 1}, (2, 40))
    assert desk.take() == CaptureWindow()


def _directory(rank: int, step: int, reason: str) -> str:
    return f"/dumps/rank{rank}-step{step}-{reason}"


def test_every_rank_reports_what_the_windows_carried() -> None:
    ledger = CaptureLedger(_directory)
    counts = {"straggler": 0, "nonfinite": 0, "hang": 0, "request": 0}
    order = CaptureOrder(2, 1, "straggler", "straggler")
    first = ledger.carried(CaptureWindow(order, {**counts, "straggler": 1}), ())
    assert (first.counts, first.latest, first.files) == ({**counts, "straggler": 1, "failed": 0}, None, ())
    begun = ledger.carried(CaptureWindow(None, counts), [(order, 17)])
    assert (begun.latest, begun.files) == ((2, 17), ("/dumps/rank2-step17-straggler",))
    request = CaptureOrder(0, None, "request", "slow_io")
    ledger.carried(CaptureWindow(None, counts, None, CaptureOutcomes(settled=2)), [(request, 23)])
    failed = ledger.carried(CaptureWindow(None, counts, None, CaptureOutcomes(1, 1, 1)), ())
    assert failed.counts["failed"] == 1 and failed.latest == (0, 23)
    assert failed.files == ("/dumps/rank2-step17-straggler",)  # the request's is not named any more
    hang = ledger.hang_report(1, 30)  # the monitor's report, before the next window carries it
    assert (hang.counts, hang.latest) == ({}, (1, 30))
    assert hang.files == ("/dumps/rank2-step17-straggler", "/dumps/rank1-step30-hang")
    carried = ledger.carried(CaptureWindow(None, {**counts, "hang": 1}, (1, 30)), ())
    assert carried.files == hang.files and carried.counts["hang"] == 1
    restored = CaptureLedger(_directory)
    restored.load_state_dict(ledger.state_dict())
    assert restored.carried(CaptureWindow(None, counts), ()).files == hang.files
