"""Running totals (report/_totals.py): what changed between two totals of one series."""

from __future__ import annotations

from torchtelemetry.report import HistogramValue, difference


def _histogram(counts: tuple[float, ...]) -> HistogramValue:
    return HistogramValue(bounds=(1.0,), counts=counts, sum=sum(counts), count=sum(counts))


def test_difference_of_running_totals() -> None:
    assert difference(30.0, 10.0) == 20.0
    assert difference({"0": 5.0, "1": 2.0}, {"0": 3.0}) == {"0": 2.0, "1": 2.0}
    assert difference(_histogram((3.0, 4.0)), _histogram((1.0, 1.0))) == HistogramValue(
        (1.0,), (2.0, 3.0), 5.0, 5.0
    )
    # Not an earlier total of the same series: the caller falls back to the window's own value.
    assert difference(5.0, 10.0) is None
    assert difference({"0": 1.0}, {"0": 2.0}) is None
    assert difference(_histogram((1.0, 1.0)), HistogramValue((2.0,), (0.0, 0.0), 0.0, 0.0)) is None
