"""End to end on real DDP ranks (gloo, 127.0.0.1): the spans of the steps that matter reach a real OTLP
receiver, and the step-time histogram a real Prometheus stores links to one of them.

Four ranks train a small DDP model; rank 3 sleeps in its forward over ten times the step's own work,
so every other rank waits for it in the backward's all-reduce. The assertions are what that margin
guarantees on a loaded machine: rank 3 is every window's slowest (its spans are always there), at
most three ranks send a window's spans, each step span's children are its phases with the durations
the metrics exported for that rank and window, and the exemplar Prometheus stored opens rank 3's
trace. Spans are made on the traces thread only (the SDK's `ReadableSpan` is watched being built).
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import free_port, run_ranks
from tests.receivers import OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan
from tests.servers import PrometheusServer, binary
from torchtelemetry.run import TRACES_THREAD

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

DELAY_S = 0.25
"""Rank 3's sleep in its forward per step: over ten times the step's own work (a few ms)."""
EVERY, STEPS, WORLD_SIZE, SLOW = 4, 16, 4, 3
PHASES = {"forward": "train/phase/forward", "backward": "train/phase/backward"}
PHASES |= {"optimizer": "train/phase/optimizer", "data": "train/data_wait"}
RUN_ID = "traces-ddp"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


def _watch_span_threads() -> collections.Counter[str]:
    """Count the threads the OpenTelemetry SDK's spans are built on in this process."""
    from opentelemetry.sdk import trace

    made: collections.Counter[str] = collections.Counter()
    built = trace.ReadableSpan.__init__

    def watched(span: Any, *args: Any, **kwargs: Any) -> None:
        made[threading.current_thread().name] += 1
        built(span, *args, **kwargs)

    trace.ReadableSpan.__init__ = watched  # type: ignore[method-assign]
    return made


def _train(
    rank: int,
    world_size: int,
    endpoint: str,
    protocol: str,
    path: str,
    scrape_port: int | None,
    steps: int,
    trace_ranks: int | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train; return the threads spans were built on, the training thread's name, the threads alive
    before close, and the telemetry's checkpoint."""
    made = _watch_span_threads()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    exporters: list[Any] = [tt.JsonlExporter(path), tt.OTelExporter(endpoint=endpoint, protocol=protocol)]
    if scrape_port is not None:
        exporters.append(tt.PrometheusExporter(port=scrape_port, addr="127.0.0.1"))
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        exporters,
        every=EVERY,
        run_id=RUN_ID,
        nvml=False,
        hang_after_s=None,
        trace_ranks=trace_ranks,
    )
    first = 0
    if state is not None:
        telemetry.load_state_dict(state)
        first = state["step"] + 1
    telemetry.watch_gradient_sync(model)
    for step in range(first, first + steps):
        with telemetry.data_wait():
            batch = torch.randn(32, 64)
        with telemetry.phase("forward"):
            loss = model(batch).pow(2).mean()
            if rank == SLOW:
                time.sleep(DELAY_S)
        with telemetry.phase("backward"):
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        loss_metric.update(loss.detach(), 32)
        telemetry.step(step)
    saved = telemetry.state_dict()
    alive = [thread.name for thread in threading.enumerate()]
    telemetry.close()
    return {"made": dict(made), "training": threading.current_thread().name, "alive": alive, "state": saved}


def _reports(path: Path) -> dict[int, dict[str, Any]]:
    """Rank 0's reports by window number."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"] // EVERY: line["values"] for line in lines}


def _by_window(spans: list[ReceivedSpan]) -> dict[int, list[ReceivedSpan]]:
    windows: dict[int, list[ReceivedSpan]] = collections.defaultdict(list)
    for span in spans:
        windows[span.attributes["torchtelemetry.step"] // EVERY].append(span)
    return windows


@pytest.fixture(scope="module")
def http_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Four ranks exporting to an OTLP/HTTP receiver, rank 0 scraped by a Prometheus storing exemplars."""
    if binary("prometheus") is None:
        pytest.skip("prometheus is not installed (make system-deps)")
    workdir = tmp_path_factory.mktemp("traces")
    port = free_port()
    with (
        OtlpHttpReceiver() as receiver,
        PrometheusServer(workdir / "prometheus", features=["exemplar-storage"]) as prometheus,
    ):
        prometheus.scrape("trainer", [f"127.0.0.1:{port}"])
        started = time.time()
        results = run_ranks(
            _train,
            WORLD_SIZE,
            receiver.metrics_endpoint,
            "http/protobuf",
            str(workdir / "metrics.jsonl"),
            port,
            STEPS,
            timeout_s=300,
        )
        exemplars = prometheus.query_exemplars(
            "torchtelemetry_train_step_time_histogram_seconds_bucket", started - 60, time.time() + 60
        )
        yield {
            "results": results,
            "spans": receiver.spans(),
            "requests": receiver.received_traces,
            "reports": _reports(workdir / "metrics.jsonl"),
            "exemplars": exemplars,
        }


@pytest.mark.timeout(400)
def test_every_window_sends_spans_from_at_most_three_ranks_always_the_slow_one(
    http_run: dict[str, Any],
) -> None:
    windows = _by_window(http_run["spans"])
    assert sorted(windows) == list(range(STEPS // EVERY))
    for window, spans in windows.items():
        ranks = {span.attributes["torchtelemetry.rank"] for span in spans}
        assert SLOW in ranks and len(ranks) <= 3, (window, ranks)
    # One request per rank and window: a window's spans go out together.
    assert len(http_run["requests"]) == sum(
        len({s.attributes["torchtelemetry.rank"] for s in spans}) for spans in windows.values()
    )


@pytest.mark.timeout(400)
def test_each_step_span_has_its_phases_as_children_timed_as_the_metrics_say(http_run: dict[str, Any]) -> None:
    spans, reports = http_run["spans"], http_run["reports"]
    steps = [span for span in spans if span.name == "train.step"]
    children = collections.defaultdict(list)
    for span in spans:
        if span.parent_span_id:
            children[span.parent_span_id].append(span)
    for step in steps:
        kids = children[step.span_id]
        assert {"train.data", "train.forward", "train.backward", "train.optimizer"} <= {k.name for k in kids}
        assert {k.trace_id for k in kids} == {step.trace_id}
        for kid in kids:
            assert step.start_ns <= kid.start_ns <= kid.end_ns <= step.end_ns, kid
            assert kid.attributes == step.attributes | (
                {"torchtelemetry.phase": kid.name.removeprefix("train.")}
                if kid.name.removeprefix("train.") in PHASES
                else {}
            )
    for (window, rank), traced in _by_rank_and_window(spans).items():
        for phase, name in PHASES.items():
            per_step = sum(span.duration_s for span in traced if span.name == f"train.{phase}") / EVERY
            exported = reports[window][name][str(rank)]
            assert per_step == pytest.approx(exported, abs=1e-3), (window, rank, phase)
        waited = sum(span.duration_s for span in traced if span.name == "train.sync_wait") / EVERY
        assert waited == pytest.approx(reports[window]["train/sync_wait"][str(rank)], abs=1e-3)


def _by_rank_and_window(spans: list[ReceivedSpan]) -> dict[tuple[int, int], list[ReceivedSpan]]:
    found: dict[tuple[int, int], list[ReceivedSpan]] = collections.defaultdict(list)
    for span in spans:
        rank, step = span.attributes["torchtelemetry.rank"], span.attributes["torchtelemetry.step"]
        found[step // EVERY, rank].append(span)
    return found


@pytest.mark.timeout(400)
def test_spans_name_run_attempt_rank_and_step_and_are_made_off_the_training_thread(
    http_run: dict[str, Any],
) -> None:
    for span in http_run["spans"]:
        assert span.attributes["torchtelemetry.run_id"] == RUN_ID
        assert span.attributes["torchtelemetry.attempt"] == 0
        assert span.resource["service.instance.id"] == RUN_ID
    steps = {
        (s.attributes["torchtelemetry.rank"], s.attributes["torchtelemetry.step"])
        for s in http_run["spans"]
        if s.name == "train.step"
    }
    assert {step for rank, step in steps if rank == SLOW} == set(range(STEPS))  # every step of rank 3's
    sent = collections.Counter(span.attributes["torchtelemetry.rank"] for span in http_run["spans"])
    for rank, result in enumerate(http_run["results"]):
        assert set(result["made"]) <= {TRACES_THREAD}, result["made"]  # never the training thread
        assert sum(result["made"].values()) == sent[rank]
        assert (TRACES_THREAD in result["alive"]) == (rank in sent)  # started only where sampled


@pytest.mark.timeout(400)
def test_prometheus_stores_an_exemplar_that_opens_the_slow_ranks_trace(http_run: dict[str, Any]) -> None:
    stored = [exemplar for series in http_run["exemplars"] for exemplar in series["exemplars"]]
    assert stored, "Prometheus stored no exemplar of the step-time histogram"
    steps = {(s.trace_id, s.span_id): s for s in http_run["spans"] if s.name == "train.step"}
    for exemplar in stored:
        span = steps[exemplar["labels"]["trace_id"], exemplar["labels"]["span_id"]]
        assert span.attributes["torchtelemetry.rank"] == SLOW
        assert float(exemplar["value"]) > DELAY_S


@pytest.mark.timeout(300)
def test_over_grpc_a_windows_spans_come_from_the_slow_rank_too(tmp_path: Path) -> None:
    with OtlpGrpcReceiver() as receiver:
        run_ranks(
            _train, WORLD_SIZE, receiver.endpoint, "grpc", str(tmp_path / "m.jsonl"), None, 8, timeout_s=240
        )
        windows = _by_window(receiver.spans())
    assert sorted(windows) == [0, 1]
    for spans in windows.values():
        ranks = {span.attributes["torchtelemetry.rank"] for span in spans}
        assert SLOW in ranks and len(ranks) <= 3
        assert {span.name for span in spans} >= {"train.step", "train.forward", "train.sync_wait"}


def _resume(rank: int, world_size: int, endpoint: str, path: str) -> list[int]:
    """Train 4 steps, checkpoint, then resume from it in a new Telemetry (the next attempt)."""
    first = _train(rank, world_size, endpoint, "http/protobuf", path, None, 4)
    second = _train(rank, world_size, endpoint, "http/protobuf", path, None, 4, state=first["state"])
    return [first["state"]["attempt"], second["state"]["attempt"]]


@pytest.mark.timeout(300)
def test_a_resumed_attempts_spans_carry_the_next_attempt(tmp_path: Path) -> None:
    with OtlpHttpReceiver() as receiver:
        attempts = run_ranks(_resume, 2, receiver.metrics_endpoint, str(tmp_path / "m.jsonl"), timeout_s=240)
        spans = receiver.spans()
    assert attempts == [[0, 1], [0, 1]]
    by_attempt = collections.defaultdict(set)
    for span in spans:
        assert span.attributes["torchtelemetry.run_id"] == RUN_ID
        by_attempt[span.attributes["torchtelemetry.attempt"]].add(span.attributes["torchtelemetry.step"])
    assert by_attempt == {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}


@pytest.mark.timeout(300)
def test_trace_ranks_zero_sends_nothing_and_starts_no_thread(tmp_path: Path) -> None:
    with OtlpHttpReceiver() as receiver:
        results = run_ranks(
            _train, 2, receiver.metrics_endpoint, "http/protobuf", str(tmp_path / "m.jsonl"), None, 8, 0
        )
        receiver.wait_for(lambda received: len(received) >= 2)  # the metrics did arrive
        assert receiver.received_traces == []
    for result in results:
        assert TRACES_THREAD not in result["alive"] and result["made"] == {}
