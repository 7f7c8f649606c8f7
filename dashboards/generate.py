"""Generate dashboards/training.json from code: `python dashboards/generate.py`.

The training dashboard has fixed panels for the built-in signals of `Telemetry` (the Health row's in
dashboards/health.py, the panel builders in dashboards/panels.py) and discovers
everything else: template variables list the run's own gauges, counters and histograms from the
`torchtelemetry_` series Prometheus holds, and one panel is repeated per value (a line per gauge,
a rate per counter, a heatmap and quantiles per histogram). The names of the built-in signals
are taken from the library, so the discovery variables never list one a fixed panel shows; a
signal added without a panel of its own (`unplaced_names()`) is listed by them, so its series are
on the dashboard once this script has run. tests/stack checks that the committed JSON is what this
script writes.

(Grafana's grafana-foundation-sdk was considered: the release installable here targets the
Grafana 10.1 schema (version 36), older than these dashboards' 41, so plain dicts it is.)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded from a file

# dashboards/ is not a package: its modules are imported after the line above
from health import health_panels
from panels import (
    DATASOURCE,
    SELECTION,
    _thresholds,
    heatmap,
    layout,
    metric,
    over_ranks,
    repeated,
    selected,
    spread,
    stat,
    targets,
    timeseries,
)

OUT = Path(__file__).resolve().parent / "training.json"
HIDDEN_PARTS = ("total", "bucket", "sum", "count")
"""Sample-name endings of counters and histograms: the gauge variable never lists them."""


def builtin_names() -> list[str]:
    """Every Prometheus sample name of the built-in signals (both per-rank shapes, model FLOPs,
    CUDA allocator detail), the exporters' step and timestamp, and the export hub's health."""
    from torchtelemetry.export import (
        HEALTH_DESCRIPTORS,
        LAST_UPDATE_METRIC,
        RUN_FINISHED_METRIC,
        STEP_METRIC,
        MetricKind,
        prometheus_name,
    )
    from torchtelemetry.report import signal_descriptors

    descriptors = [
        STEP_METRIC,
        LAST_UPDATE_METRIC,
        RUN_FINISHED_METRIC,
        *HEALTH_DESCRIPTORS,
        *signal_descriptors(),
    ]
    names = set()
    for descriptor in descriptors:
        name = prometheus_name(descriptor)
        parts = ("_bucket", "_sum", "_count") if descriptor.kind is MetricKind.HISTOGRAM else ("",)
        names.update(name + part for part in parts)
    return sorted(names)


STEP_TIME_RANKS = frozenset(
    {"torchtelemetry_train_step_time_min_rank", "torchtelemetry_train_step_time_max_rank"}
)
"""In synchronous training every rank's step time is the slowest rank's, so the ranks holding the
longest and shortest one are noise (docs/stack.md): no panel shows them."""


def hidden_names() -> set[str]:
    """Built-in names no panel of this dashboard shows, on purpose: `STEP_TIME_RANKS`, each phase's
    seconds per rank (shown over ranks instead: min / median / max and their ranks), the run's
    finished mark (the alert rules read it) and the exporters' own health (exporter-health.json)."""
    from torchtelemetry.export import HEALTH_DESCRIPTORS, RUN_FINISHED_METRIC, prometheus_name
    from torchtelemetry.report import signal_descriptors

    phases = [d for d in signal_descriptors() if d.name.startswith("train/phase/")]
    return {
        *STEP_TIME_RANKS,
        *(prometheus_name(d) for d in (*phases, RUN_FINISHED_METRIC, *HEALTH_DESCRIPTORS)),
    }


def placed_names() -> set[str]:
    """Built-in names a fixed panel shows or `hidden_names()` hides: the discovery variables never
    list them."""
    from torchtelemetry.export import NAMESPACE

    queries = " ".join(
        target["expr"] for panel in builtin_panels() + health_panels() for target in panel.get("targets", [])
    )
    shown = set(re.findall(rf"\b{NAMESPACE}_\w+", queries))
    # A panel that reads a histogram's buckets shows the histogram: its `_sum` and `_count` too.
    buckets = [name.removesuffix("_bucket") for name in shown if name.endswith("_bucket")]
    shown |= {histogram + part for histogram in buckets for part in ("_sum", "_count")}
    return set(builtin_names()) & (shown | hidden_names())


def unplaced_names() -> set[str]:
    """Built-in names not `placed_names()`: a signal added without a panel of its own. The discovery
    variables list them like the run's own metrics."""
    return set(builtin_names()) - placed_names()


# -- the dashboard ------------------------------------------------------------------------------


def step_time_quantile(quantile: float) -> str:
    """A quantile of every rank's step time over each interval, from the step-time histogram."""
    buckets = selected(metric("train/step_time/histogram") + "_bucket")
    return f"histogram_quantile({quantile}, sum by (job, run, le) (rate({buckets}[$__rate_interval])))"


def builtin_panels() -> list[dict[str, Any]]:
    step_time = "torchtelemetry_train_step_time"
    data_wait_share = over_ranks("torchtelemetry_train_data_wait_share", "percent", "max")
    return [
        stat(
            "Training step",
            "Step of the latest report (torchtelemetry_train_step).",
            "none",
            targets((f"max by (job, run) ({selected('torchtelemetry_train_step')})", "{{run}}")),
            decimals=0,
        ),
        stat(
            "Time since last report",
            "Seconds since the latest report was collected; TrainingStalled fires after 300 s.",
            "s",
            targets(
                (
                    "time() - max by (job, run) "
                    f"({selected('torchtelemetry_last_update_timestamp_seconds')})",
                    "{{run}}",
                )
            ),
            thresholds=_thresholds(("green", None), ("orange", 120), ("red", 300)),
        ),
        stat(
            "Tokens seen",
            "Tokens trained on since the run started, all ranks (torchtelemetry_train_tokens_total).",
            "short",
            targets((f"sum by (job, run) ({selected(metric('train/tokens'))})", "{{run}}")),
        ),
        stat(
            "Samples seen",
            "Samples trained on since the run started, all ranks (torchtelemetry_train_samples_total).",
            "short",
            targets((f"sum by (job, run) ({selected(metric('train/samples'))})", "{{run}}")),
        ),
        stat(
            "Tokens per second",
            "Token throughput of all ranks over the latest window.",
            "short",
            targets((f"sum by (job, run) ({selected(metric('train/tokens_per_second'))})", "{{run}}")),
        ),
        stat(
            "MFU",
            "Model FLOPs utilization per device (torchtitan's formula; needs flops_per_token).",
            "percent",
            targets((f"max by (job, run) ({selected(metric('train/mfu'))})", "{{run}}")),
        ),
        stat(
            "Data wait",
            "Largest share of a window any rank spent waiting for data; DataWaitHigh fires above 20 %.",
            "percent",
            targets((data_wait_share, "{{run}}")),
            thresholds=_thresholds(("green", None), ("orange", 10), ("red", 20)),
        ),
        timeseries(
            "Throughput: tokens per second",
            "Tokens per second of all ranks together, per window.",
            "short",
            targets((selected(metric("train/tokens_per_second")), "{{run}}")),
            axis_label="tokens/s",
        ),
        timeseries(
            "Throughput: samples per second",
            "Samples per second of all ranks together, per window.",
            "short",
            targets((selected(metric("train/samples_per_second")), "{{run}}")),
            axis_label="samples/s",
        ),
        timeseries(
            "Model TFLOP/s per device",
            "Model FLOPs achieved per device and second, in TFLOP/s (flops_per_token x tokens/s per device).",
            "short",
            targets((selected(metric("train/tflops_per_second")), "{{run}}")),
            axis_label="TFLOP/s",
        ),
        timeseries(
            "MFU over time",
            "Model FLOPs utilization per device: achieved model FLOP/s over the device's dense BF16 peak.",
            "percent",
            targets((selected(metric("train/mfu")), "{{run}}")),
        ),
        timeseries(
            "Step time per rank",
            "Mean host wall time of a step on each rank. In synchronous training every rank waits for "
            "the slowest one at each collective, so the lines coincide: step time cannot show stragglers.",
            "s",
            targets((selected(step_time + "_seconds"), "{{run}} rank {{rank}}")),
        ),
        timeseries(
            "Step time over ranks: min / median / max",
            "Spread of the step time over ranks: from the per-rank series, or from the min/median/max "
            "series the library exports above max_rank_series ranks.",
            "s",
            spread(step_time, "seconds"),
        ),
        timeseries(
            "Step time: median and 99th percentile, exemplars open the slowest rank's steps",
            "From the step-time histogram (the exporting rank's steps; in synchronous training every "
            "rank's take as long). Its exemplars, the dots, are the slowest rank's slowest step of each "
            "window: one opens that step's trace (the spans of its phases, data wait and all-reduce "
            "wait) in the trace store (docs/stack.md, Traces).",
            "s",
            targets(
                *(
                    (step_time_quantile(quantile), "{{run}} p" + label)
                    for quantile, label in ((0.5, "50"), (0.99, "99"))
                ),
                exemplar=True,
            ),
        ),
        timeseries(
            "Learning rate",
            "Learning rate at the end of each window (torchtelemetry_train_learning_rate).",
            "sci",
            targets((selected(metric("train/learning_rate")), "{{run}}")),
        ),
        timeseries(
            "Data wait per step over ranks: min / median / max",
            "Mean seconds per step spent waiting for the next batch, over ranks.",
            "s",
            spread("torchtelemetry_train_data_wait", "seconds"),
        ),
        timeseries(
            "Data wait share over ranks: min / median / max",
            "Share of each rank's window wall time spent waiting for data (torchtitan's data_loading %).",
            "percent",
            spread("torchtelemetry_train_data_wait_share", "percent"),
            threshold_line=20,
        ),
        timeseries(
            "Peak memory over time",
            "Peak CUDA memory allocated, or peak resident memory on CPU, max over ranks.",
            "bytes",
            targets((selected(metric("train/peak_memory")), "{{run}}")),
        ),
        timeseries(
            "CUDA allocator: max active / max reserved",
            "Peaks of the CUDA caching allocator, max over ranks (CUDA runs only).",
            "bytes",
            targets(
                (selected(metric("train/memory/max_active")), "{{run}} max active"),
                (selected(metric("train/memory/max_reserved")), "{{run}} max reserved"),
            ),
        ),
        timeseries(
            "CUDA allocator: retries and OOMs",
            "Allocations retried after flushing the allocator's cache, and out-of-memory errors, per "
            "interval, summed over ranks (CUDA runs only); AllocatorRetriesRising fires on retries.",
            "short",
            targets(
                (
                    f"increase({selected(metric('train/memory/alloc_retries'))}[$__rate_interval])",
                    "{{run}} retries",
                ),
                (
                    f"increase({selected(metric('train/memory/ooms'))}[$__rate_interval])",
                    "{{run}} OOMs",
                ),
            ),
        ),
        timeseries(
            "Tokens seen over time",
            "Tokens trained on since the run started (torchtelemetry_train_tokens_total).",
            "short",
            targets((selected(metric("train/tokens")), "{{run}}")),
        ),
    ]


def discovered_panels() -> list[dict[str, Any]]:
    bucket = selected("${histogram}_bucket")
    rates = f"sum by (job, run, le) (rate({bucket}[$__rate_interval]))"
    return [
        repeated(
            timeseries(
                "$gauge",
                "One panel per gauge of the run's own metric tree (Gauge variable), one line per series.",
                "short",
                targets((selected("$gauge"), "__auto")),
            ),
            "gauge",
        ),
        repeated(
            timeseries(
                "$counter per second",
                "One panel per counter of the run's own metric tree (Counter variable), as a rate.",
                "short",
                targets((f"rate({selected('$counter')}[$__rate_interval])", "__auto")),
            ),
            "counter",
        ),
        repeated(
            heatmap(
                "$histogram distribution",
                "One heatmap per histogram of the run's own tree: one column per interval (increase "
                "of the cumulative buckets), one cell per bucket, colour = number of observations.",
                f"sum by (le) (increase({bucket}[$__rate_interval]))",
            ),
            "histogram",
            "v",
        ),
        repeated(
            timeseries(
                "$histogram quantiles",
                "Median and 90th percentile per interval, interpolated from the histogram's buckets.",
                "none",
                targets(
                    *(
                        (f"histogram_quantile({q}, {rates})", "{{run}} p" + str(round(q * 100)))
                        for q in (0.5, 0.9)
                    )
                ),
            ),
            "histogram",
            "v",
        ),
    ]


def _query_variable(name: str, label: str, definition: str, **options: Any) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": definition, "refId": name, "qryType": 1},
        "definition": definition,
        "refresh": 2,
        "hide": 0,
        "regex": "",
        "options": [],
    } | options


def route_variable(metric: str) -> dict[str, Any]:
    """One route at a time: a run that reaches Prometheus by two routes (the scrape endpoint and the
    Pushgateway) is two copies of the same series, which no panel may add up."""
    return _query_variable(
        "route",
        "Route",
        f'label_values({metric}{{job=~"$job", run=~"$run"}}, route)',
        includeAll=False,
        multi=False,
        sort=1,
        current={},
        description="How the run reached Prometheus (scrape, pushgateway, otlp): each route carries "
        "the whole run, so the panels show one route at a time.",
    )


def _discovery_variable(name: str, label: str, pattern: str, regex: str) -> dict[str, Any]:
    definition = f'label_values({{__name__=~"{pattern}", {SELECTION[1:-1]}}}, __name__)'
    return _query_variable(
        name,
        label,
        definition,
        regex=regex,
        includeAll=True,
        multi=True,
        sort=1,
        current={"selected": True, "text": ["All"], "value": ["$__all"]},
    )


def templating() -> dict[str, Any]:
    builtin = "|".join(re.escape(name) for name in sorted(placed_names()))
    hidden = "|".join(HIDDEN_PARTS)
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {"selected": False, "text": "Prometheus", "value": "prometheus"},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "includeAll": False,
                "multi": False,
                "options": [],
            },
            _query_variable(
                "job",
                "Job",
                "label_values(torchtelemetry_train_step, job)",
                includeAll=True,
                allValue=".*",
                multi=True,
                sort=1,
                current={"selected": True, "text": ["All"], "value": ["$__all"]},
            ),
            _query_variable(
                "run",
                "Run",
                'label_values(torchtelemetry_train_step{job=~"$job"}, run)',
                includeAll=False,
                multi=True,
                sort=2,
                current={},
            ),
            route_variable("torchtelemetry_train_step"),
            _discovery_variable(
                "gauge", "Gauge", "torchtelemetry_.+", f"/^(?!(?:{builtin})$)(?!.*_(?:{hidden})$)(.+)$/"
            ),
            _discovery_variable(
                "counter", "Counter", "torchtelemetry_.+_total", f"/^(?!(?:{builtin})$)(.+)$/"
            ),
            _discovery_variable(
                "histogram", "Histogram", "torchtelemetry_.+_bucket", f"/^(?!(?:{builtin})$)(.+)_bucket$/"
            ),
        ]
    }


def build() -> dict[str, Any]:
    """The training dashboard as Grafana's JSON model."""
    return {
        "uid": "torchtelemetry-training",
        "title": "torchtelemetry: training",
        "description": "Training signals of torchtelemetry runs: progress, throughput, MFU, step time, "
        "data wait, memory, and every gauge, counter and histogram of the run's own metric tree.",
        "tags": ["torchtelemetry", "training"],
        "editable": False,
        "schemaVersion": 41,
        "version": 1,
        "graphTooltip": 1,
        "refresh": "10s",
        "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [
            {
                "title": "torchtelemetry",
                "type": "dashboards",
                "tags": ["torchtelemetry"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": templating(),
        "panels": layout(builtin_panels() + health_panels() + discovered_panels()),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
