"""docker-compose.yml, the collector config and Grafana provisioning, checked by parsing (no Docker here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.stack._stack import (
    COLLECTOR_CONFIG,
    COMPOSE,
    DASHBOARD_DIR,
    GRAFANA_PROVISIONING,
    PROMETHEUS_CONFIG,
    ROOT,
    dashboards,
    load_yaml,
)
from torchtelemetry.export import NAMESPACE, ROUTE_LABEL, ROUTES, RUN_LABEL

SERVICES = {"prometheus", "grafana", "otel-collector", "pushgateway", "tempo"}
PROBED_FROM_OUTSIDE = {"otel-collector", "tempo"}
"""Images without a shell or HTTP client to probe them with: their health endpoints are published."""
OPTIONAL_SERVICES = {"victoriametrics"}
"""Started only with their profile (`docker compose --profile scale up`)."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return load_yaml(COLLECTOR_CONFIG)


def _bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host source, container target) of each bind mount, short or long syntax."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts.append((volume["source"], volume["target"]))
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/", "~")):
            mounts.append((source, target))
    return mounts


def _published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each published port."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip", ""), str(port.get("published", "")), str(port["target"])))
            continue
        parts = str(port).split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        else:
            out.append(("", *(parts if len(parts) == 2 else ["", parts[0]])))
    return out


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_compose_runs_the_five_services_with_pinned_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES | OPTIONAL_SERVICES
    for name in OPTIONAL_SERVICES:
        assert services[name]["profiles"], f"{name} must not start without its profile"
    for name in SERVICES:
        assert "profiles" not in services[name], f"{name} must start with `docker compose up`"
    for name, service in services.items():
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), (
            f"{name}: image {image!r} is not pinned to a version"
        )
    assert "contrib" in services["otel-collector"]["image"]


def test_every_mounted_file_exists(compose: dict[str, Any]) -> None:
    mounts = [mount for service in compose["services"].values() for mount in _bind_mounts(service)]
    assert mounts
    for source, target in mounts:
        assert (ROOT / source).exists(), f"{source} (mounted at {target}) does not exist"
    named = {volume.split(":")[0] for s in compose["services"].values() for volume in s.get("volumes", [])}
    named = {volume for volume in named if not volume.startswith((".", "/", "~"))}
    assert named <= set(compose.get("volumes", {})), "named volumes must be declared"


def test_published_ports_are_loopback_only(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        published = _published(service)
        assert published, f"{name} publishes nothing"
        for host_ip, _, _ in published:
            assert host_ip == "127.0.0.1", f"{name} publishes a port on {host_ip or 'every interface'}"
        assert service.get("network_mode") != "host"


def test_health_is_checked(compose: dict[str, Any], collector: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES - PROBED_FROM_OUTSIDE:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and "127.0.0.1" in test[-1], f"{name}: healthcheck {test}"
    # The collector image has no shell or HTTP client: its health_check extension is published instead.
    health_port = _port(collector["extensions"]["health_check"]["endpoint"])
    assert "health_check" in collector["service"]["extensions"]
    assert str(health_port) in {target for _, _, target in _published(services["otel-collector"])}
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_prometheus_targets_are_compose_services_on_their_ports(
    compose: dict[str, Any], collector: dict[str, Any]
) -> None:
    """Each in-stack scrape target names a service and a port that service really listens on."""
    listening = {
        "pushgateway": {9091},
        "prometheus": {9090},
        "otel-collector": {
            _port(collector["exporters"]["prometheus"]["endpoint"]),
            collector["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"][
                "port"
            ],
        },
    }
    targets = [
        target
        for job in load_yaml(PROMETHEUS_CONFIG)["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    for target in targets:
        host, port = target.rsplit(":", 1)
        if host in ("localhost", "host.docker.internal"):
            continue
        assert host in compose["services"], f"target {target}: no such service"
        assert int(port) in listening[host], f"target {target}: {host} does not listen on {port}"
    assert "host.docker.internal:host-gateway" in compose["services"]["prometheus"]["extra_hosts"]
    mounted = dict(_bind_mounts(compose["services"]["prometheus"]))
    assert mounted["./exporters/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    assert mounted["./exporters/prometheus/alerts.yml"] == "/etc/prometheus/alerts.yml"


def test_collector_wires_otlp_through_processors_to_prometheus(collector: dict[str, Any]) -> None:
    pipelines = collector["service"]["pipelines"]
    metrics = pipelines["metrics"]
    for section in ("receivers", "processors", "exporters"):
        used = {name for pipeline in pipelines.values() for name in pipeline.get(section, [])}
        defined = set(collector.get(section) or {})
        assert used <= defined, f"{section} used but not defined: {sorted(used - defined)}"
        assert defined <= used, f"{section} defined but unused: {sorted(defined - used)}"
    assert set(collector.get("extensions") or {}) == set(collector["service"].get("extensions", []))
    assert metrics["receivers"] == ["otlp"]
    assert metrics["exporters"] == ["prometheus"]
    assert metrics["processors"][0] == "memory_limiter" and metrics["processors"][-1] == "batch"
    protocols = collector["receivers"]["otlp"]["protocols"]
    # Inside the container, bind every interface: Docker publishes the port on the host's loopback.
    assert _port(protocols["grpc"]["endpoint"]) == 4317 and protocols["grpc"]["endpoint"].startswith(
        "0.0.0.0:"
    )
    assert _port(protocols["http"]["endpoint"]) == 4318 and protocols["http"]["endpoint"].startswith(
        "0.0.0.0:"
    )


def test_collector_names_match_the_library(collector: dict[str, Any]) -> None:
    """Namespace + unit/`_total` suffixes give the library's Prometheus names; the run id becomes `run`,
    and every series says it came by OTLP (`route`, as the scrape endpoint and the Pushgateway say theirs)."""
    prometheus = collector["exporters"]["prometheus"]
    assert prometheus["namespace"] == NAMESPACE
    assert prometheus.get("add_metric_suffixes", True) is True
    assert prometheus["resource_to_telemetry_conversion"]["enabled"] is True
    actions = collector["processors"]["resource"]["attributes"]
    assert {"key": RUN_LABEL, "from_attribute": "service.instance.id", "action": "insert"} in actions
    assert {"key": ROUTE_LABEL, "value": "otlp", "action": "insert"} in actions
    assert "otlp" in ROUTES


def test_collector_ports_are_published(compose: dict[str, Any], collector: dict[str, Any]) -> None:
    published = {target for _, _, target in _published(compose["services"]["otel-collector"])}
    protocols = collector["receivers"]["otlp"]["protocols"]
    assert {str(_port(protocols["grpc"]["endpoint"])), str(_port(protocols["http"]["endpoint"]))} <= published
    mounted = dict(_bind_mounts(compose["services"]["otel-collector"]))
    config_path = mounted["./exporters/otel-collector/config.yaml"]
    assert f"--config={config_path}" in compose["services"]["otel-collector"]["command"]


def test_grafana_is_provisioned_with_the_datasource_and_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounted = dict(_bind_mounts(grafana))
    assert mounted["./exporters/grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["uid"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    scrape_interval = load_yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape_interval
    (provider,) = load_yaml(GRAFANA_PROVISIONING / "dashboards" / "torchtelemetry.yml")["providers"]
    dashboard_mount = next(
        target for source, target in _bind_mounts(grafana) if Path(source) == Path("dashboards")
    )
    assert provider["options"]["path"] == dashboard_mount
    assert dashboards() and DASHBOARD_DIR.is_dir()
    for dashboard in dashboards().values():
        (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
        assert variable["current"]["value"] == datasource["uid"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboard_mount + "/")
    assert (DASHBOARD_DIR / Path(home).name).exists()


def test_spans_go_from_the_collector_to_tempo_and_exemplars_open_them_in_grafana(
    compose: dict[str, Any], collector: dict[str, Any]
) -> None:
    """The trace store behind the step-time exemplars (docs/stack.md, Traces): Prometheus stores
    exemplars, the Collector serves them (OpenMetrics) and forwards spans to Tempo on a port it
    listens on, and Grafana's Prometheus datasource opens an exemplar's trace_id in Tempo."""
    services = compose["services"]
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    traces = collector["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"] and traces["processors"][-1] == "batch"
    (exporter,) = traces["exporters"]
    host, port = collector["exporters"][exporter]["endpoint"].rsplit(":", 1)
    assert host == "tempo" and collector["exporters"]["prometheus"]["enable_open_metrics"] is True
    tempo_config = dict(_bind_mounts(services["tempo"]))["./exporters/tempo/tempo.yaml"]
    assert f"-config.file={tempo_config}" in services["tempo"]["command"]
    tempo = load_yaml(ROOT / "exporters" / "tempo" / "tempo.yaml")
    assert _port(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]) == int(port)
    http_port = str(tempo["server"]["http_listen_port"])
    assert ("127.0.0.1", http_port, http_port) in _published(services["tempo"])
    (datasource,) = load_yaml(GRAFANA_PROVISIONING / "datasources" / "tempo.yml")["datasources"]
    assert (datasource["type"], datasource["url"]) == ("tempo", f"http://tempo:{http_port}")
    (prometheus,) = load_yaml(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert prometheus["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "datasourceUid": datasource["uid"]}
    ]
