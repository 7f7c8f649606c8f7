"""The configs of docs/scale.md, checked with the tools there are here (no Mimir, Thanos or Collector):
the agent config and every remote_write block of the doc with `promtool check config --agent`, the
Collector load balancer and gateway by their structure."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("yaml")  # absent from the GPU image `make gpu-check` runs on: skip, not an error

import yaml

from tests.servers import binary
from tests.stack._stack import COLLECTOR_CONFIG, COMPOSE, PROMETHEUS_HOST_CONFIG, ROOT, load_yaml
from torchtelemetry.export import NAMESPACE

AGENT_CONFIG = ROOT / "exporters" / "prometheus" / "prometheus-agent.yml"
LOAD_BALANCER = ROOT / "exporters" / "otel-collector" / "loadbalancer.yaml"
GATEWAY = ROOT / "exporters" / "otel-collector" / "gateway.yaml"
SCALE_DOC = ROOT / "docs" / "scale.md"
_YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.DOTALL)


def _promtool_agent(promtool: str, config: Path) -> None:
    checked = subprocess.run(
        [promtool, "check", "config", "--agent", str(config)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, f"{config.name}: {checked.stdout}{checked.stderr}"


def _doc_blocks(first_key: str) -> list[dict[str, Any]]:
    """The YAML code blocks of docs/scale.md whose first key is `first_key`."""
    blocks = [yaml.safe_load(text) for text in _YAML_BLOCK.findall(SCALE_DOC.read_text())]
    return [block for block in blocks if isinstance(block, dict) and next(iter(block)) == first_key]


def test_the_agent_config_is_valid_for_prometheus_in_agent_mode(promtool: str) -> None:
    _promtool_agent(promtool, AGENT_CONFIG)


def test_vmagent_reads_the_agent_configs_scrape_jobs() -> None:
    """The doc's vmagent command: the same file, its remote_write left to -remoteWrite.url."""
    vmagent = binary("vmagent")
    if vmagent is None:
        pytest.skip("vmagent is not installed (make system-deps installs Debian's victoria-metrics)")
    checked = subprocess.run(
        [
            vmagent,
            f"-promscrape.config={AGENT_CONFIG}",
            "-promscrape.config.strictParse=false",
            "-promscrape.config.dryRun",
            "-loggerLevel=ERROR",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    assert "vmagent -promscrape.config=exporters/prometheus/prometheus-agent.yml" in SCALE_DOC.read_text()


def test_the_compose_store_is_where_the_agent_writes_by_default() -> None:
    (remote_write,) = load_yaml(AGENT_CONFIG)["remote_write"]
    store = load_yaml(COMPOSE)["services"]["victoriametrics"]
    port = remote_write["url"].split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    assert f"127.0.0.1:{port}:8428" in store["ports"]


def test_the_agent_scrapes_what_the_host_prometheus_scrapes() -> None:
    """Same jobs, targets and label handling as prometheus-host.yml for the trainer and the gateway."""
    host = {job["job_name"]: job for job in load_yaml(PROMETHEUS_HOST_CONFIG)["scrape_configs"]}
    for job in load_yaml(AGENT_CONFIG)["scrape_configs"]:
        assert job == host[job["job_name"]], job["job_name"]


def test_every_remote_write_of_the_doc_is_a_valid_agent_config(promtool: str, tmp_path: Path) -> None:
    """VictoriaMetrics, Mimir and Thanos Receive: each block of docs/scale.md in the agent config."""
    blocks = _doc_blocks("remote_write")
    urls = [entry["url"] for block in blocks for entry in block["remote_write"]]
    assert any(url.endswith("/api/v1/push") for url in urls), "Mimir"
    assert any(url.endswith("/api/v1/receive") for url in urls), "Thanos Receive"
    assert any(url.endswith("/api/v1/write") for url in urls), "VictoriaMetrics"
    for index, block in enumerate(blocks):
        config = load_yaml(AGENT_CONFIG) | block
        path = tmp_path / f"agent-{index}.yml"
        path.write_text(yaml.safe_dump(config))
        _promtool_agent(promtool, path)


def _check_wiring(config: dict[str, Any]) -> dict[str, Any]:
    """Every component a pipeline uses is defined and every defined one is used; the metrics pipeline."""
    pipelines = config["service"]["pipelines"]
    for section in ("receivers", "processors", "exporters"):
        used = {name for pipeline in pipelines.values() for name in pipeline.get(section, [])}
        defined = set(config.get(section) or {})
        assert used == defined, f"{section}: used {sorted(used)}, defined {sorted(defined)}"
    assert set(config.get("extensions") or {}) == set(config["service"].get("extensions", []))
    return pipelines["metrics"]


def test_the_load_balancer_routes_each_series_to_one_gateway() -> None:
    balancer, gateway = load_yaml(LOAD_BALANCER), load_yaml(GATEWAY)
    metrics = _check_wiring(balancer)
    assert metrics["receivers"] == ["otlp"] and metrics["exporters"] == ["loadbalancing"]
    exporter = balancer["exporters"]["loadbalancing"]
    assert exporter["routing_key"] == "streamID"  # the deltatocumulative state is per series
    assert set(exporter["protocol"]) == {"otlp"}
    (resolver,) = exporter["resolver"].values()  # exactly one resolver
    grpc_port = gateway["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    assert {hostname.rsplit(":", 1)[1] for hostname in resolver["hostnames"]} == {grpc_port}


def test_the_gateway_turns_deltas_to_totals_and_writes_the_librarys_names() -> None:
    gateway = load_yaml(GATEWAY)
    metrics = _check_wiring(gateway)
    processors = metrics["processors"]
    assert processors[0] == "memory_limiter" and processors[-1] == "batch"
    assert "deltatocumulative" in processors
    assert gateway["processors"]["deltatocumulative"]["max_streams"] > 0  # bounded state
    # The run label comes from the same rule as the Prometheus route of config.yaml.
    assert gateway["processors"]["resource"] == load_yaml(COLLECTOR_CONFIG)["processors"]["resource"]
    assert metrics["exporters"] == ["prometheusremotewrite"]
    exporter = gateway["exporters"]["prometheusremotewrite"]
    assert exporter["namespace"] == NAMESPACE
    assert exporter["add_metric_suffixes"] is True
    assert exporter["resource_to_telemetry_conversion"]["enabled"] is True
    (agent_write,) = load_yaml(AGENT_CONFIG)["remote_write"]
    assert exporter["endpoint"] == agent_write["url"], "both routes write to the same store by default"


@pytest.mark.parametrize("path", [LOAD_BALANCER, GATEWAY])
def test_the_doc_names_each_shipped_collector_config(path: Path) -> None:
    assert f"exporters/otel-collector/{path.name}" in SCALE_DOC.read_text()
