"""Dashboards: current-schema JSON, stable unique uids, defined variables, units, real metric names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import torchtelemetry.report
from tests.stack._stack import (
    DASHBOARD_DIR,
    DISCOVERY_VARIABLES,
    GRAFANA_GLOBAL_VARIABLES,
    STACK_DOC,
    TREES,
    dashboard_generator,
    dashboards,
    discovered,
    emitted_labels,
    emitted_names,
    exporter_descriptors,
    generated_training_dashboard,
    health_descriptors,
    own_names,
    panels,
    queried_labels,
    queried_metrics,
    rows,
    sample_names,
    substitute,
    training_descriptors,
    tree_descriptors,
    unplaced_descriptors,
    variables_used,
)
from torchtelemetry.export import MetricDescriptor
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import signal_descriptors

PANEL_TYPES = {"timeseries", "heatmap", "stat"}
EXPECTED = {
    "training.json": "torchtelemetry-training",
    "exporter-health.json": "torchtelemetry-exporter-health",
}

DASHBOARDS = dashboards()


def _ids(item: Any) -> str:
    return item.name if isinstance(item, Path) else str(item)


def _queries(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel["targets"]]


def _run_names(tree: str) -> frozenset[str]:
    """Sample names Prometheus holds for a run of `TREES[tree]` (CPU or CUDA)."""
    descriptors = (*tree_descriptors(tree), *signal_descriptors(), *health_descriptors())
    return frozenset(name for d in (*descriptors, *exporter_descriptors()) for name in sample_names(d))


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def _expanded_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every query, a repeated panel's once per value its variable lists for each tree in `TREES`."""
    variables = _variables(dashboard)
    out = []
    for panel in panels(dashboard):
        repeat = panel.get("repeat")
        exprs = [target["expr"] for target in panel["targets"]]
        if repeat is None:
            out.extend(exprs)
            continue
        for tree in TREES:
            for value in sorted(discovered(variables[repeat], _run_names(tree))):
                out.extend(substitute(expr, {repeat: value}, keep_others=True) for expr in exprs)
    return out


def test_dashboards_are_valid_json_with_stable_unique_uids() -> None:
    assert {path.name: d["uid"] for path, d in DASHBOARDS.items()} == EXPECTED
    for path in DASHBOARD_DIR.glob("*.json"):
        json.loads(path.read_text())


@pytest.mark.parametrize("path", list(DASHBOARDS), ids=_ids)
def test_dashboard_uses_the_current_schema_and_panel_types(path: Path) -> None:
    dashboard = DASHBOARDS[path]
    assert dashboard["schemaVersion"] >= 39
    assert dashboard.get("id") is None, "provisioned dashboards carry a uid, not a database id"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        assert panel["type"] in PANEL_TYPES, f"{panel['title']}: type {panel['type']}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0


@pytest.mark.parametrize("path", list(DASHBOARDS), ids=_ids)
def test_every_panel_has_a_datasource_a_unit_and_queries(path: Path) -> None:
    for panel in panels(DASHBOARDS[path]):
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert panel["description"], f"{title}: no description"
        assert panel["targets"], f"{title}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], title
            assert target["expr"].strip(), title
        if panel["type"] == "heatmap":
            assert panel["options"]["yAxis"]["unit"], f"{title}: no y-axis unit"
            assert all(target.get("format") == "heatmap" for target in panel["targets"])


@pytest.mark.parametrize("path", list(DASHBOARDS), ids=_ids)
def test_every_variable_used_is_defined(path: Path) -> None:
    dashboard = DASHBOARDS[path]
    defined = [variable["name"] for variable in dashboard["templating"]["list"]]
    discovery = list(DISCOVERY_VARIABLES) if path.name == "training.json" else []
    assert defined == ["datasource", "job", "run", "route", *discovery]
    used = variables_used(json.dumps(dashboard["panels"]))
    used |= variables_used(json.dumps(dashboard["templating"]))
    assert used - GRAFANA_GLOBAL_VARIABLES <= set(defined), sorted(
        used - GRAFANA_GLOBAL_VARIABLES - set(defined)
    )
    assert {"datasource", "job", "run", "route"} <= used
    for query in _queries(dashboard):
        assert "$job" in query and "$run" in query, f"{query!r} ignores the job/run selection"
        assert query.count("$route") == query.count("$run"), f"{query!r}: a selector ignores the route"


@pytest.mark.parametrize("path", list(DASHBOARDS), ids=_ids)
def test_one_route_at_a_time(path: Path) -> None:
    """A run can reach Prometheus by several routes at once (scrape endpoint and Pushgateway): each is
    a whole copy of the run, so the route is a single-valued variable every selector respects."""
    route = _variables(DASHBOARDS[path])["route"]
    assert route["multi"] is False and route["includeAll"] is False
    assert route["definition"].endswith(", route)")
    assert "$job" in route["definition"] and "$run" in route["definition"]


@pytest.mark.parametrize("path", list(DASHBOARDS), ids=_ids)
def test_panels_query_only_what_the_library_emits(path: Path) -> None:
    dashboard = DASHBOARDS[path]
    queries = _expanded_queries(dashboard) + [
        v["definition"]
        for v in dashboard["templating"]["list"]
        if "definition" in v and v["name"] not in DISCOVERY_VARIABLES
    ]
    for query in queries:
        metrics = queried_metrics(query)
        assert metrics, f"{query!r} queries no torchtelemetry metric"
        assert metrics <= emitted_names(), f"not emitted: {sorted(metrics - emitted_names())}"
        assert queried_labels(query) <= emitted_labels(), (
            f"{query!r}: {queried_labels(query) - emitted_labels()}"
        )


GENERATOR = dashboard_generator()


def test_dashboards_show_everything_the_library_emits() -> None:
    """Built-in signals in fixed panels; each tree's own metrics in the panels repeated for them."""
    by_name = {
        path.name: set().union(*map(queried_metrics, _expanded_queries(d))) for path, d in DASHBOARDS.items()
    }
    training = {min(sample_names(d)) for d in training_descriptors()} - GENERATOR.hidden_names()
    assert training <= by_name["training.json"], sorted(training - by_name["training.json"])
    health = {min(sample_names(d)) for d in health_descriptors()}
    assert health <= by_name["exporter-health.json"], sorted(health - by_name["exporter-health.json"])


def test_stack_doc_lists_every_panel() -> None:
    doc = STACK_DOC.read_text()
    for path, dashboard in DASHBOARDS.items():
        assert dashboard["title"] in doc, f"docs/stack.md does not describe {path.name}"
        for panel in panels(dashboard):
            assert f"**{panel['title']}**" in doc, f"docs/stack.md does not list panel {panel['title']!r}"


@pytest.mark.parametrize("tree", list(TREES))
def test_discovery_variables_list_exactly_the_trees_own_metrics(tree: str) -> None:
    """Gauges, counters and histograms of the tree, never a health metric or a built-in signal that
    a fixed panel shows (one without a panel of its own is listed: `unplaced_names()`)."""
    variables = _variables(DASHBOARDS[DASHBOARD_DIR / "training.json"])
    listed = {name: discovered(variables[name], _run_names(tree)) for name in DISCOVERY_VARIABLES}
    assert listed == own_names(tree, unplaced_descriptors())


def _unused_path(stem: str) -> str:
    """`stem`, lengthened until no built-in signal and no tree of `TREES` exports a name of that path."""
    taken = {d.name for d in training_descriptors()}
    path = stem
    while path in taken:
        path += "_x"
    return path


def test_a_signal_added_without_a_panel_is_shown_by_the_discovered_panels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new built-in gauge and counter, with no panel written for them (docs/signals.md: a panel of
    its own is optional): the regenerated dashboard lists them in its Gauge and Counter variables (so
    the repeated panels show them), and only them besides the run's own metrics. Their names are
    made up unused, so that a real signal of the same name can never clash with them."""
    added = (
        MetricDescriptor(_unused_path("train/made_up_gauge"), description="a made-up gauge"),
        MetricDescriptor(_unused_path("train/made_up_count"), MetricKind.COUNTER, description="made up"),
    )
    unplaced = [*unplaced_descriptors(), *added]  # beside the real signals without a panel
    builtin = torchtelemetry.report.signal_descriptors
    monkeypatch.setattr(torchtelemetry.report, "signal_descriptors", lambda: (*builtin(), *added))
    generator = dashboard_generator()
    assert generator.unplaced_names() == {name for d in unplaced for name in sample_names(d)}
    variables = _variables(generator.build())
    names = _run_names("demo") | {name for d in unplaced for name in sample_names(d)}
    listed = {name: discovered(variables[name], names) for name in DISCOVERY_VARIABLES}
    assert listed == own_names("demo", unplaced)


def test_a_signal_described_twice_under_one_path_leaves_the_dashboard_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A made-up signal of a real signal's name (the test above once made up `train/grad_scale`)
    describes that path twice: the panel that reads it is built once, as before."""
    expected = generated_training_dashboard()
    builtin = torchtelemetry.report.signal_descriptors
    (tokens,) = [d for d in builtin() if d.name == "train/tokens"]
    monkeypatch.setattr(torchtelemetry.report, "signal_descriptors", lambda: (*builtin(), tokens))
    assert dashboard_generator().render() == expected


def test_no_panel_ranks_step_times_or_divides_them_into_a_straggler_ratio() -> None:
    """Synchronous training makes every rank's step time the slowest rank's (docs/stack.md): the
    straggler panels read the phases' straggler scores."""
    for dashboard in DASHBOARDS.values():
        for panel in panels(dashboard):
            for target in panel["targets"]:
                queried = queried_metrics(target["expr"])
                assert not queried & GENERATOR.STEP_TIME_RANKS, panel["title"]
                assert "step_time" not in target["expr"] or "/" not in target["expr"], panel["title"]
                if "straggler" in panel["title"].lower():
                    assert all("_straggler_" in name for name in queried), panel["title"]


def test_the_training_dashboard_has_a_health_row_read_from_the_signals() -> None:
    dashboard = DASHBOARDS[DASHBOARD_DIR / "training.json"]
    assert any(title.startswith("Health") for title in rows(dashboard))
    queried = {name for query in _queries(dashboard) for name in queried_metrics(query)}
    for name in (
        "torchtelemetry_train_phases_share_percent",
        "torchtelemetry_train_straggler_score",
        "torchtelemetry_train_straggler_top_rank",
        "torchtelemetry_train_nonfinite_count_total",
        "torchtelemetry_train_memory_headroom_min_bytes",
        "torchtelemetry_train_goodput_ratio",
        "torchtelemetry_hw_gpu_throttled_max",
    ):
        assert name in queried, name


def test_fixed_panels_are_only_for_the_built_in_signals() -> None:
    dashboard = DASHBOARDS[DASHBOARD_DIR / "training.json"]
    fixed = set().union(
        *(queried_metrics(t["expr"]) for p in panels(dashboard) if "repeat" not in p for t in p["targets"])
    )
    own = {name for tree in TREES for d in tree_descriptors(tree) for name in sample_names(d)}
    assert not fixed & own, sorted(fixed & own)


def test_the_training_dashboard_is_what_the_generator_writes() -> None:
    assert (DASHBOARD_DIR / "training.json").read_text() == generated_training_dashboard(), (
        "dashboards/training.json is stale: run `python dashboards/generate.py`"
    )


def test_goodput_reads_no_checkpoint_yet_until_it_is_known() -> None:
    """A run exports no goodput before its first durable checkpoint: the panel says so, never a red 0 %."""
    dashboard = DASHBOARDS[DASHBOARD_DIR / "training.json"]
    (panel,) = [panel for panel in panels(dashboard) if panel["title"] == "Goodput"]
    assert panel["fieldConfig"]["defaults"]["noValue"] == "no checkpoint yet"
    assert all(
        queried_metrics(target["expr"]) == {"torchtelemetry_train_goodput_ratio"}
        for target in panel["targets"]
    )
