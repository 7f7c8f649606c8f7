"""`torchtelemetry demo` shows every signal a CPU can show: its 2 ranks scraped by a real Prometheus,
every query of dashboards/*.json (as Grafana runs it, a repeated panel once per metric its variable
lists) returns data, except those of names a healthy CPU run cannot export: the CUDA-only ones
(`cuda_only_descriptors()`), those exported only once something happened (`event_only_descriptors()`:
a non-finite value, a straggler, a capture, a hang) and MFU (`NEEDS_PEAK_FLOPS`)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.demo._process import demo_process
from tests.distributed import free_port
from tests.servers import PrometheusServer, QueryError, query
from tests.stack._live import listed_by_discovery, panel_queries
from tests.stack._stack import cuda_only_names, dashboards, event_only_names, queried_metrics, sample_names
from torchtelemetry.report import signal_descriptors

pytestmark = pytest.mark.timeout(300)

RUN_ID = "demo-dashboards"
NEEDS_PEAK_FLOPS = "train/mfu"
"""Model FLOP/s over the device's peak: no peak is known for a CPU, so a CPU run has no MFU."""


def _not_on_a_healthy_cpu_run() -> frozenset[str]:
    (mfu,) = [descriptor for descriptor in signal_descriptors() if descriptor.name == NEEDS_PEAK_FLOPS]
    return cuda_only_names() | event_only_names() | sample_names(mfu)


def _missing(url: str, values: dict[str, str]) -> list[str]:
    """Each query a healthy CPU run can fill that returns no data now."""
    missing = []
    left_out = _not_on_a_healthy_cpu_run()
    for path, dashboard in dashboards().items():
        for panel, target, expr in panel_queries(
            dashboard, values, listed_by_discovery(url, dashboard, values)
        ):
            if queried_metrics(expr) <= left_out:
                continue
            try:
                found = query(url, expr)
            except QueryError as error:
                found = []
                expr = f"{expr} ({error})"
            if not found:
                missing.append(f"{path.name} / {panel['title']} / {target['refId']}: {expr}")
    return missing


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
        args = ["--steps", "100000", "--every", "5", "--checkpoint-every", "20", "--step-delay", "0.02",
                "--prometheus-port", str(port), "--run-id", RUN_ID, "--no-console"]  # fmt: skip
        with demo_process(args, tmp_path) as demo:
            deadline = time.monotonic() + 180
            missing = _missing(prometheus.url, values)
            while missing and time.monotonic() < deadline and demo.poll() is None:
                time.sleep(2)
                missing = _missing(prometheus.url, values)
            shares = prometheus.query(f'torchtelemetry_train_phases_share_percent{{run="{RUN_ID}"}}')
            demo.send_signal(signal.SIGINT)
            output, _ = demo.communicate(timeout=90)
    assert not missing, "panels without data:\n" + "\n".join(missing)
    assert {share.labels["phase"] for share in shares} == {"data", "forward", "backward", "optimizer"}
    assert demo.returncode == 130, output
    assert (tmp_path / "runs" / RUN_ID / "checkpoint" / "checkpoint.pt").stat().st_mode & 0o777 == 0o600
    written = {path.name for path in tmp_path.iterdir()} - {"prometheus"}
    assert written == {"runs"}, f"the demo writes under runs/<run id> alone, not {sorted(written)}"
