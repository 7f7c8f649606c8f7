"""Past one Prometheus: a real 2-rank run, scraped by Prometheus in agent mode with the shipped
`exporters/prometheus/prometheus-agent.yml`, remote-written to a real VictoriaMetrics, read back.

Both routes of the agent config carry the run: its `torchtelemetry` job scrapes rank 0's
`PrometheusExporter`, its `torchtelemetry-pushgateway` job (honor_labels) a Pushgateway that rank 0's
`PushgatewayExporter` pushes to under the job "pushed". While the ranks train, every dashboard
variable and panel query runs against VictoriaMetrics' Prometheus query API; after the run, every
sample VictoriaMetrics stored for it is compared with the report rank 0 wrote to JSONL at the same
step, to the 12 significant digits VictoriaMetrics keeps.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import free_port, run_ranks
from tests.servers import PrometheusServer, PushgatewayServer, VictoriaMetricsServer
from tests.stack._live import check_dashboards, still_training, wait_for_ranks
from tests.stack._stack import PROMETHEUS_DIR, TREES, load_yaml
from tests.stack._training import RUN_LIMIT_S, train_until_stopped
from torchtelemetry.export import NAMESPACE

AGENT_CONFIG = PROMETHEUS_DIR / "prometheus-agent.yml"
TREE = "demo"
SCRAPE_JOB = "torchtelemetry"
"""The agent config's job for rank 0's endpoint."""
PUSHED_JOB = "pushed"
"""The job rank 0 pushes under (kept by the config's honor_labels), apart from the scrape job."""
REL_TOL = 5e-12
"""VictoriaMetrics stores a float as a 12-significant-digit decimal: half a unit in the 12th digit."""


def _train(
    rank: int, world_size: int, port: int, gateway_url: str, jsonl: str, run_id: str, stop: str
) -> Any:
    """The demo tree and every signal a CPU run can show on each rank, until told to stop; rank 0
    exports to the scrape endpoint, the Pushgateway and JSONL. Returns rank 0's descriptors."""
    from torchtelemetry.export import JsonlExporter, PrometheusExporter, PushgatewayExporter
    from torchtelemetry.telemetry import Telemetry

    metrics = TREES[TREE]()
    telemetry = Telemetry(
        metrics,
        exporters=[
            PrometheusExporter(port=port),
            PushgatewayExporter(gateway_url, job=PUSHED_JOB),
            JsonlExporter(jsonl),
        ],
        every=2,
        run_id=run_id,
        flops_per_token=6e6,
        peak_flops=1e12,
        queue_size=1024,  # JSONL must keep every report the endpoints served
        dump_dir=Path(stop).parent,  # the straggler's captures
    )
    try:
        train_until_stopped(telemetry, TREE, metrics, rank, stop)
    finally:
        telemetry.close()
    return [(d.name, d.kind.value, d.unit, d.label_name) for d in telemetry.descriptors]


def _agent(workdir: Path, trainer: str, gateway: str, store: VictoriaMetricsServer) -> PrometheusServer:
    """Prometheus in agent mode running the shipped config, its targets and URL pointed at the test's."""
    config = load_yaml(AGENT_CONFIG)
    targets = {"torchtelemetry-pushgateway": gateway, SCRAPE_JOB: trainer}
    agent = PrometheusServer(workdir, agent=True, external_labels=config["global"].get("external_labels"))
    for job in config["scrape_configs"]:
        agent.scrape(job["job_name"], [targets[job["job_name"]]], honor_labels=job.get("honor_labels", False))
    (remote_write,) = config["remote_write"]
    options = {key: value for key, value in remote_write.items() if key != "url"}
    # Sent every second instead of every 5 s: the 1 s scrapes reach the store in time for 4 s rates.
    options["queue_config"] = options.get("queue_config", {}) | {"batch_send_deadline": "1s"}
    agent.remote_write(store.write_url, **options)
    return agent.start()


def _expected_samples(record: dict[str, Any], descriptors: list[tuple]) -> dict[tuple, float]:
    """What an exposition of this JSONL report holds: `(name, sorted labels) -> value` (`le` as a
    number: the Pushgateway writes 1.0 as "1")."""
    from torchtelemetry.export import LAST_UPDATE_METRIC, STEP_METRIC, MetricDescriptor, prometheus_name
    from torchtelemetry.metric import MetricKind

    expected: dict[tuple, float] = {
        (prometheus_name(STEP_METRIC), ()): float(record["step"]),
        (prometheus_name(LAST_UPDATE_METRIC), ()): record["timestamp"],
    }
    for name, kind, unit, label in descriptors:
        descriptor = MetricDescriptor(name, MetricKind(kind), unit, "", label)
        value = record["values"].get(name)
        if value is None or name.startswith("exporter/"):
            continue  # unfed, or the hub's health (each exporter is sent its own counts)
        series = prometheus_name(descriptor)
        if descriptor.kind is MetricKind.HISTOGRAM:
            running = 0.0
            for bound, count in zip([*value["bounds"], math.inf], value["counts"], strict=True):
                running += count
                expected[(f"{series}_bucket", (("le", bound),))] = running
            expected[(f"{series}_sum", ())] = value["sum"]
            expected[(f"{series}_count", ())] = value["count"]
        elif isinstance(value, dict):
            for key, entry in value.items():
                expected[(series, ((label, key),))] = entry
        else:
            expected[(series, ())] = value
    return expected


def _compare(
    stored: list[dict[str, Any]], reports: dict[tuple[int, float], dict[tuple, float]], job: str
) -> tuple[int, set]:
    """Check every sample of `job` against the report the same scrape carried (`reports` by step and
    timestamp: the step and the report's time scraped with it tell it apart from the final report's
    amendment, of the same step); returns the samples compared and the steps seen."""
    own_labels = {"__name__", "job", "instance", "run", "route", "cluster"}
    namespace = f"{NAMESPACE}_"  # not the Pushgateway's own push_time_seconds
    series = [
        s for s in stored if s["metric"]["job"] == job and s["metric"]["__name__"].startswith(namespace)
    ]
    steps_at, updated_at = (
        {
            timestamp: value
            for s in series
            if s["metric"]["__name__"] == name
            for timestamp, value in zip(s["timestamps"], s["values"], strict=True)
            if not _staleness_marker(value)
        }
        for name in ("torchtelemetry_train_step", "torchtelemetry_last_update_timestamp_seconds")
    )
    report_at = {
        timestamp: min(
            (key for key in reports if key[0] == step), key=lambda key: abs(key[1] - updated_at[timestamp])
        )
        for timestamp, step in steps_at.items()
    }
    compared, mismatches = 0, []
    for s in series:
        name = s["metric"]["__name__"]
        labels = {k: float(v) if k == "le" else v for k, v in s["metric"].items() if k not in own_labels}
        key = (name, tuple(sorted(labels.items())))
        for timestamp, value in zip(s["timestamps"], s["values"], strict=True):
            if _staleness_marker(value) or timestamp not in steps_at:
                continue  # a staleness marker (the target went away), or a sample of no report
            expected = reports[report_at[timestamp]].get(key)
            if expected is None:
                assert name in ("torchtelemetry_run_finished_timestamp_seconds",) or name.startswith(
                    "torchtelemetry_exporter_"
                ), f"{job}: {key} at step {steps_at[timestamp]} is in no report"
                continue
            compared += 1
            if not math.isclose(value, expected, rel_tol=REL_TOL):
                mismatches.append(
                    f"{key} at step {steps_at[timestamp]}: stored {value!r}, reported {expected!r}"
                )
    assert not mismatches, f"{job}: {len(mismatches)} samples differ:\n" + "\n".join(mismatches[:20])
    return compared, {int(step) for step in steps_at.values()}


def _staleness_marker(value: float | None) -> bool:
    """Whether a stored value is Prometheus' end-of-series marker (VictoriaMetrics exports it as null)."""
    return value is None or math.isnan(value)


def _wait_for_stored(store: VictoriaMetricsServer, selector: str, timeout_s: float = 60.0) -> None:
    """Wait until `store` holds a sample (not a staleness marker) of a series matching `selector`."""
    deadline = time.monotonic() + timeout_s
    while not any(not _staleness_marker(v) for series in store.export(selector) for v in series["values"]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no sample of {selector} stored within {timeout_s} s")
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_two_rank_run_through_a_prometheus_agent_reads_back_exactly_from_victoriametrics(
    tmp_path: Path, pushgateway: PushgatewayServer, victoriametrics: VictoriaMetricsServer
) -> None:
    run_id, port, stop = f"remote-write-{uuid.uuid4().hex[:8]}", free_port(), tmp_path / "stop"
    jsonl = tmp_path / "reports.jsonl"
    agent = _agent(tmp_path / "agent", f"127.0.0.1:{port}", pushgateway.address, victoriametrics)
    url = victoriametrics.url
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            ranks = pool.submit(
                run_ranks, _train, 2, port, pushgateway.url, str(jsonl), run_id, str(stop), timeout_s=300
            )
            try:
                for job in (SCRAPE_JOB, PUSHED_JOB):
                    selector = f'job="{job}", run="{run_id}"'
                    wait_for_ranks(
                        ranks, url, f"torchtelemetry_exporter_last_success_timestamp_seconds{{{selector}}}"
                    )
                    wait_for_ranks(
                        ranks, url, f"count(torchtelemetry_train_step_time_seconds{{{selector}}}) == 2"
                    )
                check = check_dashboards(
                    url, TREE, {"scrape": SCRAPE_JOB, "pushgateway": PUSHED_JOB}, run_id, "4s"
                )
                still_training(ranks, RUN_LIMIT_S)
                assert not check.missing, "panel queries without data in VictoriaMetrics:\n" + "\n".join(
                    check.missing
                )
            finally:
                stop.touch()
            descriptors = ranks.result()[0]
        # close() pushed the final report with the finished marker, and the endpoint waited for a
        # scrape of it. The endpoint is gone now (its series end in staleness markers): read raw samples.
        for job in (SCRAPE_JOB, PUSHED_JOB):
            _wait_for_stored(
                victoriametrics,
                f'torchtelemetry_run_finished_timestamp_seconds{{job="{job}", run="{run_id}"}}',
            )
    finally:
        agent.stop()

    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    steps = [record["step"] for record in records]
    # A report per window; close() amends the last with the goodput of a checkpoint marked after it.
    *windows, last = steps
    assert windows == sorted(set(windows)) and last >= windows[-1] and len(windows) > 3, steps
    reports = {
        (record["step"], record["timestamp"]): _expected_samples(record, descriptors) for record in records
    }
    stored = victoriametrics.export(f'{{run="{run_id}"}}')
    assert {s["metric"]["cluster"] for s in stored} == {"training"}  # the config's external label
    seen: dict[str, set[int]] = defaultdict(set)
    for job in (SCRAPE_JOB, PUSHED_JOB):
        compared, seen[job] = _compare(stored, reports, job)
        assert compared > 100, (job, compared)
    final = max(steps)
    assert final in seen[PUSHED_JOB], "the gateway keeps the final report"
    assert len(seen[SCRAPE_JOB]) > 3 and len(seen[PUSHED_JOB]) > 3, seen
