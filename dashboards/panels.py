"""Grafana panel builders shared by dashboards/generate.py and dashboards/health.py (plain dicts of
Grafana's JSON model, schema 41)."""

from __future__ import annotations

from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTION = '{job=~"$job", run=~"$run", route=~"$route"}'


def selected(name: str) -> str:
    """`name` restricted to the selected jobs and runs, as they reached Prometheus by the selected route."""
    return name + SELECTION


def target(
    expr: str, legend: str, ref: str, *, heatmap: bool = False, exemplar: bool = False
) -> dict[str, Any]:
    """One query; `exemplar`: Grafana also asks Prometheus for the exemplars of the series it reads
    (each a dot that opens its trace, through the datasource's `exemplarTraceIdDestinations`)."""
    out = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "instant": False,
        "refId": ref,
    }
    return out | ({"format": "heatmap"} if heatmap else {}) | ({"exemplar": True} if exemplar else {})


def targets(*queries: tuple[str, str], exemplar: bool = False) -> list[dict[str, Any]]:
    return [
        target(expr, legend, chr(ord("A") + i), exemplar=exemplar) for i, (expr, legend) in enumerate(queries)
    ]


def _thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for color, value in steps]}


def _panel(kind: str, title: str, description: str, width: int, height: int, queries: list[dict[str, Any]]):
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": height},
        "targets": queries,
    }


def stat(
    title: str,
    description: str,
    unit: str,
    queries: list[dict[str, Any]],
    *,
    decimals: int | None = None,
    thresholds: dict[str, Any] | None = None,
    no_value: str | None = None,
) -> dict[str, Any]:
    """A stat panel; `no_value` is shown (uncoloured) while the query returns nothing."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": thresholds or _thresholds(("green", None)),
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if no_value is not None:
        defaults["noValue"] = no_value
    return _panel("stat", title, description, 3, 4, queries) | {
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "textMode": "auto",
            "orientation": "auto",
            "wideLayout": True,
            "showPercentChange": False,
        },
    }


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[dict[str, Any]],
    *,
    axis_label: str = "",
    threshold_line: float | None = None,
    width: int = 12,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10,
        "showPoints": "auto",
        "pointSize": 4,
        "spanNulls": False,
        "axisLabel": axis_label,
        "axisPlacement": "auto",
        "lineInterpolation": "linear",
        "stacking": {"mode": "none", "group": "A"},
    }
    thresholds = _thresholds(("green", None))
    if threshold_line is not None:
        custom["thresholdsStyle"] = {"mode": "dashed"}
        thresholds = _thresholds(("green", None), ("red", threshold_line))
    return _panel("timeseries", title, description, width, 8, queries) | {
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom,
                "color": {"mode": "palette-classic"},
                "thresholds": thresholds,
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def heatmap(title: str, description: str, expr: str) -> dict[str, Any]:
    return _panel("heatmap", title, description, 12, 8, [target(expr, "{{le}}", "A", heatmap=True)]) | {
        "fieldConfig": {
            "defaults": {
                "unit": "short",
                "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"},
                },
            },
            "overrides": [],
        },
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": "Oranges",
                "fill": "dark",
                "scale": "exponential",
                "exponent": 0.5,
                "steps": 64,
                "reverse": False,
            },
            "yAxis": {"axisPlacement": "left", "unit": "none", "reverse": False},
            "rowsFrame": {"layout": "auto"},
            "cellValues": {"unit": "short"},
            "legend": {"show": True},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": True},
            "filterValues": {"le": 1e-09},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
        },
    }


def repeated(panel: dict[str, Any], variable: str, direction: str = "h") -> dict[str, Any]:
    """`panel` once per value of `variable`."""
    extra: dict[str, Any] = {"repeat": variable, "repeatDirection": direction}
    if direction == "h":  # Grafana splits the full width between the copies, at most two a row
        extra["maxPerRow"] = 2
        extra["gridPos"] = panel["gridPos"] | {"w": 24}
    return panel | extra


def over_ranks(name: str, unit_suffix: str, stat_name: str) -> str:
    """`stat_name` (min/median/max) over the per-rank series of `name`, or the series the library
    exports instead above `max_rank_series` ranks."""
    per_rank = selected(f"{name}_{unit_suffix}")
    wide = selected(f"{name}_{stat_name}_{unit_suffix}")
    if stat_name == "median":
        return f"quantile by (job, run) (0.5, {per_rank}) or max by (job, run) ({wide})"
    return f"{stat_name} by (job, run) ({per_rank}) or max by (job, run) ({wide})"


def spread(name: str, unit_suffix: str) -> list[dict[str, Any]]:
    return targets(*((over_ranks(name, unit_suffix, s), "{{run}} " + s) for s in ("min", "median", "max")))


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ids in order, and positions: left to right, wrapping at 24 columns."""
    x = y = row_height = 0
    for number, panel in enumerate(panels, start=1):
        grid = panel["gridPos"]
        if x + grid["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        panel["id"] = number
        panel["gridPos"] = {"x": x, "y": y, "w": grid["w"], "h": grid["h"]}
        x += grid["w"]
        row_height = max(row_height, grid["h"])
    return panels


def metric(path: str) -> str:
    """The Prometheus name of the built-in signal at `path`, read from the signal objects (a path
    described twice is one name: the last description of it)."""
    from torchtelemetry.export import prometheus_name
    from torchtelemetry.report import signal_descriptors

    by_path = {d.name: d for d in signal_descriptors()}
    if path not in by_path:
        raise KeyError(
            f"dashboards: no built-in signal exports {path!r}; a panel reads what a signal describes"
        )
    return prometheus_name(by_path[path])
