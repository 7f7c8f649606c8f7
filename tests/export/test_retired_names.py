"""The exporters that serve values across reports (the scrape endpoint, a Pushgateway group) stop
serving a name once a later window leaves it out, and keep serving the values only logged."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import torchtelemetry as tt
from tests.servers import http_get
from torchtelemetry.export import Exporter


def _served(body: bytes) -> dict[str, dict[str, float]]:
    """Each served sample's name -> {its phase or rank label: value}."""
    served: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            label = sample.labels.get("phase", sample.labels.get("rank", ""))
            served.setdefault(sample.name, {})[label] = sample.value
    return served


@pytest.mark.parametrize("route", ["scrape", "pushgateway"])
def test_a_phase_a_later_window_did_not_enter_is_no_longer_served(
    route: str, request: pytest.FixtureRequest
) -> None:
    if route == "scrape":
        scraped = tt.PrometheusExporter(port=0)
        exporter: Exporter = scraped

        def body() -> bytes:
            return http_get(scraped.url)
    else:
        gateway = request.getfixturevalue("pushgateway")  # skips without the binary
        exporter = tt.PushgatewayExporter(gateway.url)

        def body() -> bytes:
            return http_get(f"{gateway.url}/metrics")

    metrics = {"train/loss": tt.WeightedMeanMetric()}
    telemetry = tt.Telemetry(metrics, [exporter], every=2, phases=("forward", "eval"), window_lines=False)
    seen = []
    try:
        for step in range(4):
            with telemetry.phase("forward"):
                pass
            if step < 2:  # the first window evaluates, the second does not
                with telemetry.phase("eval"):
                    pass
            metrics["train/loss"].update(torch.tensor(float(step)))
            telemetry.step(step)
            if step == 0:
                telemetry.log({"log/lr": 0.1}, step)  # logged once: served until logged again
            if step % 2 == 1:
                assert telemetry.flush(30)
                seen.append(_served(body()))
    finally:
        telemetry.close(timeout_s=5)
    first, second = seen
    assert first["torchtelemetry_train_phase_eval_seconds"].keys() == {"0"}
    assert first["torchtelemetry_train_phases_share_percent"].keys() == {"forward", "eval"}
    assert "torchtelemetry_train_phase_eval_seconds" not in second  # the per-rank series of the phase
    assert second["torchtelemetry_train_phases_share_percent"].keys() == {"forward"}
    assert second["torchtelemetry_train_phase_forward_seconds"].keys() == {"0"}
    assert second["torchtelemetry_train_loss"] == {"": 2.5}  # the second window's mean of 2 and 3
    assert second["torchtelemetry_log_lr"] == {"": 0.1}  # a logged value is no window's to retire
