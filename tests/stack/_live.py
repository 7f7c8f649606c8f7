"""Every dashboard variable and panel query, run against a live Prometheus query API the way Grafana
runs them (a Prometheus server, or a store that speaks its API, such as VictoriaMetrics)."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tests.servers import http_get, query, wait_for
from tests.stack._stack import (
    DISCOVERY_VARIABLES,
    cuda_only_names,
    dashboards,
    discovered,
    discovery_query,
    event_only_names,
    own_names,
    panels,
    queried_metrics,
    substitute,
    unplaced_descriptors,
)

WAIT_FOR_DATA_S = 30.0
"""How long the panel queries may take, all together, to return data once the run's series exist."""


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


@dataclass
class DashboardCheck:
    """What `check_dashboards` found wrong."""

    missing: list[str] = field(default_factory=list)
    """Panel queries that returned no data."""
    added_up: list[str] = field(default_factory=list)
    """Panel queries whose result is not what the selected route's copy of the run alone gives."""


def check_dashboards(
    url: str,
    tree: str,
    copies: Mapping[str, str],
    run_id: str,
    rate_interval: str,
    *,
    instances: Mapping[str, str] | None = None,
    settled: Callable[[], float] | None = None,
) -> DashboardCheck:
    """Check every dashboard against the query API at `url` for run `run_id` of `TREES[tree]`, which
    reached it by each route of `copies` (route -> the job it carries there): the job, run and route
    variables list them, the discovery variables list the tree's own metrics and nothing else but
    built-in signals without a panel of their own (`unplaced_descriptors`: a panel is optional, the
    discovered panels show them once emitted; their own tests show what they emit), and each panel
    query (variables substituted, a repeated panel once per value) returns data within
    `WAIT_FOR_DATA_S`, but those only a CUDA run (`cuda_only_names`) or an unhealthy one
    (`event_only_names`: a non-finite value, a straggler, a capture, a hang) can fill. With
    `instances` (route -> the `instance` its copy came from), each query must also give, at the
    moment `settled()` returns, exactly what the same query over that one copy gives: no panel adds
    up copies of the run."""
    check = DashboardCheck()
    queries: list[tuple[str, str, str]] = []  # where, route, query
    allowed = own_names(tree, unplaced_descriptors())
    not_emitted = cuda_only_names() | event_only_names()  # by a healthy CPU run
    for path, dashboard in dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        selector, label = variable_query(variables["job"])
        listed_jobs = label_values(url, label, selector)
        assert set(copies.values()) <= listed_jobs, (path.name, listed_jobs)
        selector, label = variable_query(variables["run"])
        runs = label_values(url, label, substitute(selector, {"job": variables["job"]["allValue"]}))
        assert run_id in runs, (path.name, runs)
        selector, label = variable_query(variables["route"])
        routes = label_values(url, label, substitute(selector, {"job": ".*", "run": run_id}))
        assert routes == set(copies), (path.name, routes)
        for route, job in copies.items():
            values = {
                "datasource": "prometheus",
                "job": job,
                "run": run_id,
                "route": route,
                "__rate_interval": rate_interval,
            }
            listed = listed_by_discovery(url, dashboard, values)
            if listed:
                own = own_names(tree)
                shown = all(own[kind] <= listed[kind] <= allowed[kind] for kind in listed)
                assert shown, (path.name, route, listed, own)
            for panel, target, expr in panel_queries(dashboard, values, listed):
                if queried_metrics(expr) <= not_emitted:
                    continue  # CUDA and NVML detail, and what only happens in an unhealthy run
                where = f"{path.name} / {panel['title']} / {target['refId']} ({route})"
                queries.append((where, route, expr))
    missing = without_data(url, [expr for _, _, expr in queries], timeout_s=WAIT_FOR_DATA_S)
    for where, route, expr in queries:
        if expr in missing:
            check.missing.append(f"{where}: {expr}")
        elif instances is not None and settled is not None:
            at = settled()
            shown = _result(url, expr, at)
            alone = _result(url, _pinned(expr, instances[route]), at)
            if not _same_result(shown, alone):
                check.added_up.append(f"{where}: {shown}, the {route} copy alone: {alone}")
    return check


def without_data(url: str, exprs: Sequence[str], *, timeout_s: float) -> set[str]:
    """Those of `exprs` that return no data at `url` within `timeout_s` all together (each query is
    run again while some are still without data: a rate needs two scrapes)."""
    deadline = time.monotonic() + timeout_s
    pending = set(exprs)
    while True:
        pending = {expr for expr in pending if not query(url, expr)}
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(1)


def listed_by_discovery(url: str, dashboard: dict[str, Any], values: dict[str, str]) -> dict[str, set[str]]:
    """What each discovery variable of `dashboard` lists at `url` for the other variables' `values`."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    return {
        name: discovered_in(url, variables[name], values) for name in DISCOVERY_VARIABLES if name in variables
    }


def panel_queries(
    dashboard: dict[str, Any], values: dict[str, str], listed: Mapping[str, set[str]]
) -> Iterator[tuple[dict[str, Any], dict[str, Any], str]]:
    """(panel, target, query) of every query of `dashboard` as Grafana runs it with the variables'
    `values`: a panel repeated over a discovery variable once per value `listed` for it."""
    for panel in panels(dashboard):
        repeat = panel.get("repeat")
        for value in sorted(listed[repeat]) if repeat else [None]:
            for target in panel["targets"]:
                yield panel, target, substitute(target["expr"], values | ({repeat: value} if repeat else {}))


def _result(url: str, expr: str, at: float) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(sample.labels.items())): sample.value for sample in query(url, expr, at=at)}


def _same_result(shown: dict[Any, float], alone: dict[Any, float]) -> bool:
    """The same series with the same values, NaN equal to NaN (a quantile over buckets that did not
    grow in the rate window is NaN in both, which adds nothing up)."""
    return shown.keys() == alone.keys() and all(
        shown[key] == alone[key] or (math.isnan(shown[key]) and math.isnan(alone[key])) for key in shown
    )


def _pinned(expr: str, instance: str) -> str:
    """`expr` (route substituted) restricted further to the one target that route's copy came from."""
    return re.sub(r'route=~"([^"]*)"', rf'route=~"\1", instance="{instance}"', expr)


def still_training(ranks: Future[Any], limit_s: float) -> None:
    """Fail if the ranks finished (on their own after `limit_s`, or failing) before the dashboards
    were checked: a finished run's rates are 0 (the Pushgateway keeps its last report), so its
    histogram quantiles are NaN, which a store like VictoriaMetrics returns as no data."""
    if ranks.done():
        ranks.result()  # raises the ranks' error
        raise AssertionError(
            f"the ranks stopped training ({limit_s:.0f} s) before the dashboards were checked"
        )


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
