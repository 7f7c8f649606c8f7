"""ConsoleExporter and JsonlExporter: the embedded exporters that need no server."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from torchtelemetry import ConsoleExporter, JsonlExporter
from torchtelemetry.export import ExportHub, ExportResult, HistogramValue, MetricDescriptor, RunInfo

RUN = RunInfo(run_id="run-7")
HISTOGRAM = HistogramValue(bounds=(0.5, 1.0), counts=(1.0, 2.0, 1.0), sum=3.0, count=4.0)
REPORT = {
    "train/loss": 0.123456789,
    "step_time": {"0": 0.25, "1": 0.5},
    "grad_norm": HISTOGRAM,
}


def test_console_writes_one_compact_line_per_report() -> None:
    stream = io.StringIO()
    exporter = ConsoleExporter(stream)
    exporter.describe([], RUN)
    assert exporter.export(12, REPORT, 1700000000.0) is ExportResult.SUCCESS
    assert exporter.export(13, {"train/loss": math.nan}, 1700000001.0) is ExportResult.SUCCESS
    first, second = stream.getvalue().splitlines()
    assert first.endswith(
        "step 12 [run-7] train/loss=0.1235 step_time=0:0.25,1:0.5 grad_norm=hist(n=4 mean=0.75)"
    )
    assert second.endswith("step 13 [run-7] train/loss=nan")
    exporter.close()
    assert exporter.export(14, REPORT, 1.0) is ExportResult.FAILURE
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()


def test_console_under_the_hub_shows_exporter_trouble_only() -> None:
    stream = io.StringIO()
    console = ConsoleExporter(stream)
    hub = ExportHub([console], run=RUN)
    hub.describe([MetricDescriptor("train/loss")])
    hub.submit(1, {"train/loss": 1.0})
    hub.close(30)
    (line,) = stream.getvalue().splitlines()
    assert "exporter" not in line  # health metrics stay out of the line while all is well
    trouble = console.format_line(2, {"exporter/errors": {"otlp": 3.0, "console": 0.0}}, 0.0)
    assert trouble.endswith("| errors:otlp=3")


def test_jsonl_appends_one_standard_json_object_per_report(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "metrics.jsonl"
    exporter = JsonlExporter(path)
    assert not path.exists()  # nothing opened before describe
    exporter.describe([], RUN)
    report = {**REPORT, "train/min": math.inf, "train/max": -math.inf, "bad": {"0": math.nan}}
    assert exporter.export(3, report, 1700000000.5) is ExportResult.SUCCESS
    assert exporter.force_flush(5)
    exporter.close()
    again = JsonlExporter(path)  # a second run appends
    again.describe([], RunInfo(run_id="run-8"))
    again.export(4, {"train/loss": 1.0}, 1700000001.0)
    again.close()
    lines = path.read_text().splitlines()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # no NaN/Infinity tokens
    assert records == [
        {
            "step": 3,
            "timestamp": 1700000000.5,
            "run_id": "run-7",
            "values": {
                "train/loss": 0.123456789,
                "step_time": {"0": 0.25, "1": 0.5},
                "grad_norm": {"bounds": [0.5, 1.0], "counts": [1.0, 2.0, 1.0], "sum": 3.0, "count": 4.0},
                "train/min": "Infinity",  # non-finite values as OTel JSON writes them: strings
                "train/max": "-Infinity",
                "bad": {"0": "NaN"},
            },
        },
        {"step": 4, "timestamp": 1700000001.0, "run_id": "run-8", "values": {"train/loss": 1.0}},
    ]


def test_jsonl_failures_are_reported_not_raised(tmp_path: Path) -> None:
    exporter = JsonlExporter(tmp_path / "m.jsonl")
    assert exporter.export(1, {"x": 1.0}, 0.0) is ExportResult.FAILURE  # before describe
    exporter.describe([], RUN)
    assert exporter.export(1, {"x": object()}, 0.0) is ExportResult.FAILURE  # type: ignore[dict-item]
    exporter.close()
    assert exporter.export(2, {"x": 1.0}, 0.0) is ExportResult.FAILURE
    with pytest.warns(RuntimeWarning, match="already closed"):
        exporter.close()


def test_jsonl_never_follows_a_symlink_and_makes_its_file_private(tmp_path: Path) -> None:
    """A link planted at the path (its name is public: a run's log directory) is never written
    through; the exporter says so, and its exports fail instead of raising into training."""
    target = tmp_path / "someone_elses_file"
    target.write_text("theirs\n")
    planted = tmp_path / "metrics.jsonl"
    planted.symlink_to(target)
    exporter = JsonlExporter(planted)
    exporter.describe([], RUN)
    assert exporter.export(1, {"x": 1.0}, 0.0) is ExportResult.FAILURE
    exporter.close()
    assert target.read_text() == "theirs\n"
    fresh = JsonlExporter(tmp_path / "new.jsonl")
    fresh.describe([], RUN)
    fresh.close()
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o600
