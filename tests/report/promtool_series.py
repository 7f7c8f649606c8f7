"""Which RankStraggler alerts a run's exported reports fire: the reports of a JSONL file as the
Prometheus series they are exported as (one window a minute), evaluated by promtool on the
shipped rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from torchtelemetry.export import prometheus_name
from torchtelemetry.report import signal_descriptors

ALERTS = Path(__file__).resolve().parents[2] / "exporters" / "prometheus" / "alerts.yml"
READ = ("train/straggler/score", "train/straggler/threshold", "train/straggler/rank", "train/straggler/cost")
_FIRED = re.compile(
    r'alertname="RankStraggler".*?phase="([^"]+)".*?\n\s*Annotations:\{description="Rank (\d+) '
)


def rank_straggler_alerts(reports: list[dict[str, Any]], workdir: Path) -> set[tuple[str, int]]:
    """(phase, rank named) of every RankStraggler alert firing at any minute of the run, whose
    window `i` is scraped at minute `i` (rules evaluated every 15 s)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    descriptors = {descriptor.name: descriptor for descriptor in signal_descriptors()}
    series = []
    for path in READ:
        phases = sorted({phase for values in reports for phase in values.get(path, {})})
        for phase in phases:
            samples = [_sample(values.get(path, {}).get(phase)) for values in reports]
            name = prometheus_name(descriptors[path])
            series.append(
                {"series": f'{name}{{job="trainer", run="r", phase="{phase}"}}', "values": " ".join(samples)}
            )
    checks = [
        {"eval_time": f"{minute}m", "alertname": "RankStraggler", "exp_alerts": []}
        for minute in range(len(reports))
    ]
    test = {
        "rule_files": [ALERTS.name],
        "evaluation_interval": "15s",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }
    shutil.copy(ALERTS, workdir / ALERTS.name)
    (workdir / "run_test.yml").write_text(json.dumps(test))
    result = subprocess.run(
        [promtool, "test", "rules", "run_test.yml"], cwd=workdir, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    if result.returncode == 0:
        return set()
    got = [part.split("got:", 1)[1] for part in output.split("exp:") if "got:" in part]
    fired = {(phase, int(rank)) for part in got for phase, rank in _FIRED.findall(part)}
    assert fired, output  # promtool failed for another reason
    return fired


def _sample(value: float | None) -> str:
    return "_" if value is None else repr(float(value))
