"""Every dashboard query and alert rule against a real Prometheus that scraped a real 2-rank run,
once for each metric tree in `TREES` (the demo's and one that shares no name with it).

The run exports through both routes the stack offers to Prometheus at once, as
exporters/prometheus/prometheus-host.yml scrapes them: the scrape endpoint
(`PrometheusExporter`, job "torchtelemetry") and the Pushgateway
(`PushgatewayExporter`, scraped with the repository's `honor_labels` job, so the
series keep the pushed job, "torchtelemetry" too). The two copies of the run differ
only in `instance` and `route`. The discovery variables, read from Prometheus, must
list exactly the tree's own metrics; each panel query, with its variables substituted
as Grafana would (a repeated panel once per value), must return data on each route,
and exactly what the copy of that route alone gives: the totals a stat panel shows are
the run's true totals, never the sum of two copies.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import free_port, run_ranks
from tests.servers import PrometheusServer, PushgatewayServer, QueryError, Sample, query
from tests.stack._live import check_dashboards, still_training, wait_for_ranks
from tests.stack._stack import (
    PROMETHEUS_HOST_CONFIG,
    TREES,
    alert_rules,
    dashboards,
    load_yaml,
    panels,
    substitute,
)
from tests.stack._training import RUN_LIMIT_S, SAMPLES, TOKENS, train_until_stopped

WORLD_SIZE = 2
JOB = "torchtelemetry"
"""`PushgatewayExporter`'s default job (kept by `honor_labels`), and the shipped scrape job's name."""
ROUTES = ("scrape", "pushgateway")
SETTLED_SCRAPES = 3


def _train(
    rank: int, world_size: int, tree: str, port: int, gateway_url: str, run_id: str, stop_file: str
) -> int:
    """A tree's metrics plus every signal a CPU run can show on one rank, exported through both
    routes, until told to stop."""
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
        dump_dir=Path(stop_file).parent,  # the straggler's captures
    )
    try:
        return train_until_stopped(telemetry, tree, metrics, rank, stop_file)
    finally:
        telemetry.close()


def _settled(prometheus: PrometheusServer) -> float:
    """A recent moment whose scrapes Prometheus has ingested whole (it keeps ingesting the present)."""
    return time.time() - SETTLED_SCRAPES * prometheus.scrape_interval_s


def _at_a_settled_moment(url: str, expr: str, settled: Callable[[], float]) -> tuple[list[Sample], float]:
    """`expr`'s samples at a `settled()` moment where it has some, and that moment (a scrape that
    timed out on a loaded host marks the series stale until the next one)."""
    deadline = time.monotonic() + 30
    while not (found := query(url, expr, at=(at := settled()))):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {expr} at any settled moment for 30 s")
        time.sleep(1)
    return found, at


def _panel_expr(dashboard: dict[str, Any], title: str) -> str:
    (panel,) = [panel for panel in panels(dashboard) if panel["title"] == title]
    (target,) = panel["targets"]
    return target["expr"]


EXPORTER_OF_ROUTE = {"scrape": "prometheus", "pushgateway": "pushgateway"}


def _check_totals(url: str, values: dict[str, str], settled: Callable[[], float]) -> list[str]:
    """The stat panels' totals against what the run fed up to the step of the report they show:
    tokens and samples, and the reports exported by the exporter of the route (every report is a
    window of `every=2` steps; the report counts itself), at a `settled()` moment that has a step
    (a scrape that timed out on a loaded host marks the series stale until the next one)."""
    selector = f'job="{values["job"]}", run="{values["run"]}", route="{values["route"]}"'
    (step,), at = _at_a_settled_moment(url, f"torchtelemetry_train_step{{{selector}}}", settled)
    steps = step.value + 1  # the report of step s covers steps 0..s
    expected = {
        "Tokens seen": [steps * TOKENS * WORLD_SIZE],
        "Samples seen": [steps * SAMPLES * WORLD_SIZE],
        "Reports exported": [steps / 2],
    }
    exporter = EXPORTER_OF_ROUTE[values["route"]]
    wrong = []
    for dashboard in dashboards().values():
        for title, truth in expected.items():
            if not any(panel["title"] == title for panel in panels(dashboard)):
                continue
            expr = substitute(_panel_expr(dashboard, title), values)
            shown = [
                sample.value
                for sample in query(url, expr, at=at)
                if sample.labels.get("exporter", exporter) == exporter
            ]
            if shown != truth:
                wrong.append(f"{title} ({values['route']}): {shown}, fed {truth} by step {step.value:.0f}")
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES))
def test_every_panel_and_alert_on_a_real_two_rank_run(
    tmp_path: Path, prometheus: PrometheusServer, pushgateway: PushgatewayServer, tree: str
) -> None:
    run_id, port, stop_file = f"stack-{tree}-{uuid.uuid4().hex[:8]}", free_port(), tmp_path / "stop"
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS_HOST_CONFIG)["scrape_configs"]}
    gateway_job = "torchtelemetry-pushgateway"
    assert {JOB, gateway_job} <= set(jobs), "the shipped config scrapes both routes"
    prometheus.scrape(JOB, [f"127.0.0.1:{port}"], honor_labels=jobs[JOB].get("honor_labels", False))
    prometheus.scrape(gateway_job, [pushgateway.address], honor_labels=jobs[gateway_job]["honor_labels"])
    prometheus.start()
    url = prometheus.url
    rate_interval = f"{4 * round(prometheus.scrape_interval_s)}s"  # Grafana: 4 x the scrape interval
    with ThreadPoolExecutor(max_workers=1) as pool:
        ranks = pool.submit(
            run_ranks, _train, WORLD_SIZE, tree, port, pushgateway.url, run_id, str(stop_file), timeout_s=240
        )
        try:
            instances = {}
            for route in ROUTES:
                # Health gauges appear from the second report on; then every series exists.
                selector = f'job="{JOB}", run="{run_id}", route="{route}"'
                wait_for_ranks(
                    ranks, url, f"torchtelemetry_exporter_last_success_timestamp_seconds{{{selector}}}"
                )
                wait_for_ranks(
                    ranks, url, f"count(torchtelemetry_train_step_time_seconds{{{selector}}}) == 2"
                )
                # Queries are evaluated a few scrapes in the past, where every copy is ingested
                # whole: wait until every series has been there that long.
                wait_for_ranks(
                    ranks,
                    url,
                    f"count_over_time(torchtelemetry_exporter_last_success_timestamp_seconds{{{selector}}}[1m])"
                    f" >= {SETTLED_SCRAPES * 2}",
                )
                (step,) = query(url, f"torchtelemetry_train_step{{{selector}}}")
                instances[route] = step.labels.get("instance", "")
            assert instances["scrape"] != instances["pushgateway"], "two copies of the run, one per target"

            copies = dict.fromkeys(ROUTES, JOB)
            check = check_dashboards(
                url,
                tree,
                copies,
                run_id,
                rate_interval,
                instances=instances,
                settled=lambda: _settled(prometheus),
            )
            still_training(ranks, RUN_LIMIT_S)
            assert not check.missing, "panel queries without data:\n" + "\n".join(check.missing)
            wrong = check.added_up
            for route in ROUTES:
                values = {"job": JOB, "run": run_id, "route": route, "__rate_interval": rate_interval}
                wrong += _check_totals(url, values, lambda: _settled(prometheus))
            assert not wrong, "panels adding up copies of the run:\n" + "\n".join(wrong)

            per_rank, _ = _at_a_settled_moment(
                url,
                f'torchtelemetry_train_step_time_seconds{{job="{JOB}", run="{run_id}", route="scrape"}}',
                lambda: _settled(prometheus),
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
