"""How each backend spells a metric path (export/_naming.py), and the clashes it finds."""

from __future__ import annotations

import pytest

from torchtelemetry.export import (
    MetricDescriptor,
    MetricKind,
    NameCollisionError,
    TrackerKeys,
    check_unique,
    otel_name,
    otel_unit,
    prometheus_label_name,
    prometheus_name,
)

COUNTER, HISTOGRAM = MetricKind.COUNTER, MetricKind.HISTOGRAM


@pytest.mark.parametrize(
    ("descriptor", "name"),
    [
        (MetricDescriptor("train/loss"), "torchtelemetry_train_loss"),
        (MetricDescriptor("train/step_time", unit="seconds"), "torchtelemetry_train_step_time_seconds"),
        (MetricDescriptor("latency_seconds", unit="seconds"), "torchtelemetry_latency_seconds"),
        (MetricDescriptor("train/tokens", COUNTER, unit="tokens"), "torchtelemetry_train_tokens_total"),
        (MetricDescriptor("requests_total", COUNTER), "torchtelemetry_requests_total"),
        (MetricDescriptor("loss_total"), "torchtelemetry_loss_total"),  # gauges keep what they are given
        (MetricDescriptor("val.top-1"), "torchtelemetry_val_top_1"),
        (MetricDescriptor("grad_norm", HISTOGRAM), "torchtelemetry_grad_norm"),
    ],
)
def test_prometheus_names(descriptor: MetricDescriptor, name: str) -> None:
    assert prometheus_name(descriptor) == name


def test_prometheus_names_without_namespace_are_still_legal() -> None:
    assert prometheus_name(MetricDescriptor("loss"), namespace="") == "loss"
    assert prometheus_name(MetricDescriptor("0/loss"), namespace="") == "_0_loss"


@pytest.mark.parametrize(
    ("label", "name"),
    [("rank", "rank"), ("class-id", "class_id"), ("__name", "name"), ("1st", "_1st"), ("", "label")],
)
def test_prometheus_label_names(label: str, name: str) -> None:
    assert prometheus_label_name(label) == name


def test_otel_names_and_units() -> None:
    assert otel_name(MetricDescriptor("train/loss")) == "train.loss"
    assert (otel_unit("seconds"), otel_unit("tokens"), otel_unit("furlongs")) == ("s", "{token}", "furlongs")
    assert (otel_unit("percent"), otel_unit("tflops_per_second")) == ("%", "{TFLOP}/s")


def test_collisions_list_every_clash() -> None:
    descriptors = [
        MetricDescriptor("a/b"),
        MetricDescriptor("a.b"),
        MetricDescriptor("a-b"),
        MetricDescriptor("c/d"),
        MetricDescriptor("c.d"),
        MetricDescriptor("ok"),
    ]
    with pytest.raises(NameCollisionError) as raised:
        check_unique(descriptors, prometheus_name, "Prometheus")
    message = str(raised.value)
    assert "['a/b', 'a.b', 'a-b'] -> 'torchtelemetry_a_b'" in message
    assert "['c/d', 'c.d'] -> 'torchtelemetry_c_d'" in message
    assert check_unique(descriptors[3:4] + descriptors[5:], prometheus_name, "Prometheus") == {
        "c/d": "torchtelemetry_c_d",
        "ok": "torchtelemetry_ok",
    }


def test_tracker_keys_of_histogram_fields_clash_with_metrics_when_described() -> None:
    descriptors = [
        MetricDescriptor("grad", HISTOGRAM),
        MetricDescriptor("grad/count"),
        MetricDescriptor("grad/mean", COUNTER),
        MetricDescriptor("grad/other"),
    ]
    with pytest.raises(NameCollisionError) as raised:
        TrackerKeys("MLflow", histogram_fields=("count", "sum", "mean")).describe(descriptors)
    message = str(raised.value)
    assert "['grad', 'grad/count'] -> 'grad/count'" in message
    assert "['grad', 'grad/mean'] -> 'grad/mean'" in message
    assert "grad/other" not in message and "grad/sum" not in message
    TrackerKeys("W&B").describe(descriptors)  # a native histogram takes only its own key


def test_tracker_keys_keep_the_first_label_value_of_a_key_for_the_whole_run(caplog) -> None:
    keys = TrackerKeys("T")
    keys.describe([MetricDescriptor("queue", label_name="host"), MetricDescriptor("queue/host_c")])
    keyed, left_out = keys.keyed({"queue": {"a/b": 1.0, "a_b": 2.0, "c": 3.0, "d e": 4}})
    assert keyed == [("queue/host_a_b", 1.0), ("queue/host_d_e", 4.0)]
    assert left_out == [
        "queue host='a_b' takes the key 'queue/host_a_b' of queue host='a/b' and is left out",
        "queue host='c' takes the key 'queue/host_c' of queue/host_c and is left out",
    ]
    assert caplog.text.count("takes the key") == 2
    keyed, left_out = keys.keyed({"queue": {"a_b": 5.0}})  # the key still means 'a/b'
    assert (keyed, len(left_out), caplog.text.count("takes the key")) == ([], 1, 2)  # logged once
    with pytest.raises(NameCollisionError, match=r"\[\"queue host='d e'\", 'queue/host_d_e'\]"):
        keys.describe([MetricDescriptor("queue/host_d_e")])  # a key a label value already has
    assert keys.keyed({"queue": {"d e": 6.0}}) == ([("queue/host_d_e", 6.0)], [])  # nothing changed
