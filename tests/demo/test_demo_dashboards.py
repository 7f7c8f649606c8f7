"""`torchtelemetry demo` shows every signal a CPU can show: its 2 ranks scraped by a real Prometheus,
every panel of dashboards/*.json (each query as Grafana runs it, a repeated panel once per metric its
variable lists) returns data, except the panels of `EXEMPT`, each with the reason a healthy CPU run
leaves it empty, and the queries of CUDA-only series beside a panel's CPU ones (the ranks holding
the CUDA memory extremes beside the one holding the largest resident memory)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.servers import PrometheusServer, QueryError, query
from tests.stack._live import listed_by_discovery, panel_queries
from tests.stack._stack import cuda_only_names, dashboards, panels, queried_metrics

pytestmark = pytest.mark.timeout(300)

RUN_ID = "demo-dashboards"
CUDA = "the CUDA caching allocator's or the device's: a CUDA run only"
NVML = "NVML's GPU health: a CUDA run only"
EXEMPT = {
    "MFU": "needs the device's peak FLOP/s, and none is known for a CPU",
    "MFU over time": "needs the device's peak FLOP/s, and none is known for a CPU",
    "CUDA allocator: max active / max reserved": CUDA,
    "CUDA allocator: retries and OOMs": CUDA,
    "CUDA memory over ranks: allocated, reserved, fragmentation, headroom": CUDA,
    "GPU power, temperature, SM clock, utilization: min / max over ranks": NVML,
    "GPU: ranks at the extremes, throttling": NVML,
    "Slowest ranks": "names the ranks that straggle two windows running: a healthy run has none",
    "First non-finite value: rank and step": "once a non-finite value was fed: a healthy run has none",
    "Hang: rank, step, lost ranks, stack file": "while a rank hangs",
    "Hang: seconds since the rank furthest behind moved, by the phase it stopped in": "while a rank hangs",
    "Capture: latest rank, step, directories": "once a verdict (a straggler, a non-finite value, a hang) "
    "or a request took a capture: a healthy run has none",
}


def _missing(url: str, values: dict[str, str]) -> list[str]:
    """Each query of a panel not in `EXEMPT` that returns no data now."""
    missing = []
    for path, dashboard in dashboards().items():
        for panel, target, expr in panel_queries(
            dashboard, values, listed_by_discovery(url, dashboard, values)
        ):
            if panel["title"] in EXEMPT or queried_metrics(expr) <= cuda_only_names():
                continue
            try:
                found = query(url, expr)
            except QueryError as error:
                found = []
                expr = f"{expr} ({error})"
            if not found:
                missing.append(f"{path.name} / {panel['title']} / {target['refId']}: {expr}")
    return missing


def test_every_exempt_panel_is_on_a_dashboard() -> None:
    titles = {panel["title"] for dashboard in dashboards().values() for panel in panels(dashboard)}
    assert set(EXEMPT) <= titles, sorted(set(EXEMPT) - titles)


def test_the_demo_fills_every_panel_a_cpu_can_fill(tmp_path: Path) -> None:
    port = free_port()
    with PrometheusServer(tmp_path / "prometheus") as prometheus:
        prometheus.scrape("torchtelemetry", [f"127.0.0.1:{port}"])
        values = {
            "datasource": "prometheus",
            "job": "torchtelemetry",
            "run": RUN_ID,
            "route": "scrape",
            "__rate_interval": f"{4 * round(prometheus.scrape_interval_s)}s",  # Grafana: 4 scrapes
        }
        demo = subprocess.Popen(
            [sys.executable, "-m", "torchtelemetry.demo", "--steps", "100000", "--every", "5",
             "--checkpoint-every", "20", "--step-delay", "0.02", "--prometheus-port", str(port),
             "--run-id", RUN_ID, "--no-console"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            missing = _missing(prometheus.url, values)
            while missing and time.monotonic() < deadline and demo.poll() is None:
                time.sleep(2)
                missing = _missing(prometheus.url, values)
            shares = prometheus.query(f'torchtelemetry_train_phases_share_percent{{run="{RUN_ID}"}}')
            demo.send_signal(signal.SIGINT)
            output, _ = demo.communicate(timeout=90)
        finally:
            if demo.poll() is None:
                demo.kill()
    assert not missing, "panels without data:\n" + "\n".join(missing)
    assert {share.labels["phase"] for share in shares} == {"data", "forward", "backward", "optimizer"}
    assert demo.returncode == 130, output
    assert (tmp_path / "runs" / RUN_ID / "checkpoint" / "checkpoint.pt").stat().st_mode & 0o777 == 0o600
