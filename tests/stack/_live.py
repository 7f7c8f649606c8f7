"""Every dashboard variable and panel query, run against a live Prometheus query API the way Grafana
runs them (a Prometheus server, or a store that speaks its API, such as VictoriaMetrics)."""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from tests.servers import http_get, wait_for
from tests.stack._stack import (
    DISCOVERY_VARIABLES,
    cuda_only_names,
    dashboards,
    discovered,
    discovery_query,
    own_names,
    panels,
    queried_metrics,
    substitute,
)


def label_values(url: str, label: str, match: str) -> set[str]:
    """What Grafana's `label_values(match, label)` lists."""
    params = urllib.parse.urlencode({"match[]": match})
    return set(json.loads(http_get(f"{url}/api/v1/label/{label}/values?{params}"))["data"])


def variable_query(variable: dict[str, Any]) -> tuple[str, str]:
    """(metric selector, label) of a `label_values(selector, label)` variable."""
    definition = variable["definition"]
    assert definition.startswith("label_values(") and definition.endswith(")"), definition
    selector, label = definition[len("label_values(") : -1].rsplit(",", 1)
    return selector.strip(), label.strip()


def discovered_in(url: str, variable: dict[str, Any], values: dict[str, str]) -> set[str]:
    """What a discovery variable lists, read from the query API at `url` as Grafana reads it."""
    selector, _ = discovery_query(variable)
    return discovered(variable, label_values(url, "__name__", substitute(selector, values)))


def panel_queries_without_data(
    url: str, tree: str, jobs: Sequence[str], run_id: str, rate_interval: str
) -> list[str]:
    """Check every dashboard against the query API at `url` for run `run_id` of `TREES[tree]`
    exported under each of `jobs`: the job and run variables list them, the discovery variables
    list exactly the tree's own metrics; return each panel query (variables substituted, a repeated
    panel once per value) that returned no data, CUDA-only ones left out."""
    missing: list[str] = []
    for path, dashboard in dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        selector, label = variable_query(variables["job"])
        listed_jobs = label_values(url, label, selector)
        assert set(jobs) <= listed_jobs, (path.name, listed_jobs)
        selector, label = variable_query(variables["run"])
        runs = label_values(url, label, substitute(selector, {"job": variables["job"]["allValue"]}))
        assert run_id in runs, (path.name, runs)
        for job in jobs:
            values = {"datasource": "prometheus", "job": job, "run": run_id, "__rate_interval": rate_interval}
            listed = {
                name: discovered_in(url, variables[name], values)
                for name in DISCOVERY_VARIABLES
                if name in variables
            }
            if listed:
                assert listed == own_names(tree), (path.name, job, listed)
            for panel in panels(dashboard):
                repeat = panel.get("repeat")
                for value in sorted(listed[repeat]) if repeat else [None]:
                    for target in panel["targets"]:
                        expr = substitute(target["expr"], values | ({repeat: value} if repeat else {}))
                        if queried_metrics(expr) <= cuda_only_names():
                            continue  # the CUDA allocator's detail: a CPU run has none
                        try:
                            wait_for(url, expr, timeout_s=10)
                        except TimeoutError:
                            missing.append(
                                f"{path.name} / {panel['title']} / {target['refId']} ({job}): {expr}"
                            )
    return missing


def wait_for_ranks(ranks: Future[Any], url: str, expr: str, timeout_s: float = 120.0) -> None:
    """Wait for `expr` to return data at `url`, failing at once with the ranks' error if they died first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ranks.done():
            ranks.result()  # raises the ranks' error
            raise AssertionError(f"the ranks finished before {url} had data for {expr}")
        try:
            wait_for(url, expr, timeout_s=2)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
