"""Every dashboard query and alert rule against a real Prometheus that scraped a real 2-rank run,
once for each metric tree in `TREES` (the demo's and one that shares no name with it).

The run exports through both routes the stack offers to Prometheus: the scrape
endpoint (`PrometheusExporter`, job "trainer") and the Pushgateway
(`PushgatewayExporter`, scraped with the repository's `honor_labels` job, so
the series keep the pushed job "torchtelemetry"). The discovery variables, read
from Prometheus, must list exactly the tree's own metrics, and each panel query,
with its variables substituted as Grafana would (a repeated panel once per value),
must return data on both routes.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed import free_port, run_ranks
from tests.servers import PrometheusServer, PushgatewayServer, QueryError, query
from tests.stack._live import panel_queries_without_data, wait_for_ranks
from tests.stack._stack import PROMETHEUS_CONFIG, TREES, alert_rules, feed, load_yaml

WORLD_SIZE = 2
PUSHED_JOB = "torchtelemetry"
"""`PushgatewayExporter`'s default job, kept by `honor_labels`."""
SCRAPE_JOB = "trainer"
RUN_LIMIT_S = 150.0
"""The ranks stop on their own after this long, should the test never tell them to."""


def _train(
    rank: int, world_size: int, tree: str, port: int, gateway_url: str, run_id: str, stop_file: str
) -> int:
    """Train-like loop on one rank: a tree's metrics plus every built-in signal, until told to stop."""
    import torch
    import torch.distributed as dist

    import torchtelemetry as tt
    from torchtelemetry.export import PrometheusExporter, PushgatewayExporter
    from torchtelemetry.telemetry import Telemetry

    assert tt.__name__  # the package imports with only torch
    metrics = TREES[tree]()
    telemetry = Telemetry(
        metrics,
        exporters=[PrometheusExporter(port=port), PushgatewayExporter(gateway_url)],
        every=2,
        run_id=run_id,
        flops_per_token=6e6,
        peak_flops=1e12,
    )
    generator = torch.Generator().manual_seed(rank)
    deadline = time.monotonic() + RUN_LIMIT_S
    step = 0
    try:
        while True:
            if step % 10 == 0:
                stop = torch.tensor([float(Path(stop_file).exists() or time.monotonic() > deadline)])
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
                if stop.item():
                    break
            with telemetry.data_wait():
                time.sleep(0.002)
            feed(tree, metrics, generator)
            telemetry.step(step, tokens=8 * 16, samples=8, learning_rate=1e-3 / (1 + step))
            time.sleep(0.02 * (1 + rank))  # rank 1 is the slower one
            step += 1
    finally:
        telemetry.close()
    return step


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_every_panel_and_alert_on_a_real_two_rank_run(
    tmp_path: Path, prometheus: PrometheusServer, pushgateway: PushgatewayServer, tree: str
) -> None:
    run_id, port, stop_file = f"stack-{tree}-{uuid.uuid4().hex[:8]}", free_port(), tmp_path / "stop"
    (pushgateway_job,) = [
        j for j in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"] if j["job_name"] == "pushgateway"
    ]
    prometheus.scrape(SCRAPE_JOB, [f"127.0.0.1:{port}"])
    prometheus.scrape("pushgateway", [pushgateway.address], honor_labels=pushgateway_job["honor_labels"])
    prometheus.start()
    url = prometheus.url
    rate_interval = f"{4 * round(prometheus.scrape_interval_s)}s"  # Grafana: 4 x the scrape interval
    with ThreadPoolExecutor(max_workers=1) as pool:
        ranks = pool.submit(
            run_ranks, _train, WORLD_SIZE, tree, port, pushgateway.url, run_id, str(stop_file), timeout_s=240
        )
        try:
            for job in (SCRAPE_JOB, PUSHED_JOB):
                # Health gauges appear from the second report on; then every series exists.
                selector = f'job="{job}", run="{run_id}"'
                wait_for_ranks(
                    ranks, url, f"torchtelemetry_exporter_last_success_timestamp_seconds{{{selector}}}"
                )
                wait_for_ranks(
                    ranks, url, f"count(torchtelemetry_train_step_time_seconds{{{selector}}}) == 2"
                )

            missing = panel_queries_without_data(url, tree, [SCRAPE_JOB, PUSHED_JOB], run_id, rate_interval)
            assert not missing, "panel queries without data:\n" + "\n".join(missing)

            per_rank = query(
                url, f'torchtelemetry_train_step_time_seconds{{job="{SCRAPE_JOB}", run="{run_id}"}}'
            )
            assert sorted(sample.labels["rank"] for sample in per_rank) == ["0", "1"]

            for rule in alert_rules():
                try:
                    query(url, rule["expr"])
                except QueryError as error:
                    pytest.fail(f"alert {rule['alert']} does not evaluate: {error}")
        finally:
            stop_file.touch()
        steps = ranks.result()
    assert steps[0] == steps[1] > 0
