"""Exporter faults through the real `ExportHub`: backends absent, gone, hanging, slow, and back.

Every push backend (a real Pushgateway, real OTLP/HTTP and OTLP/gRPC receivers)
sits behind a `FaultProxy`, so one exporter address sees the backend come and
go. What is asserted is what the training loop and the user can observe:
`submit()` returns, the queue bound holds (reports in flight + queued never
exceed 1 + queue_size, so the rest must already be counted), every report ends
up exported, failed or dropped, the counts reach the backend in the exported
health metrics, reports after recovery arrive, and `close()` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import torchtelemetry as tt
from tests.distributed import run_ranks
from tests.faults import FaultProxy
from tests.receivers import OtlpGrpcReceiver, OtlpHttpReceiver, attributes, metrics_by_name
from tests.servers import PushgatewayServer, http_get
from torchtelemetry.export import (
    Exporter,
    ExportHub,
    MetricDescriptor,
    OTelExporter,
    PrometheusExporter,
    PushgatewayExporter,
    RunInfo,
    WandbExporter,
)

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

QUEUE = 4
TIMEOUT_S = 0.5  # each exporter's own timeout: short, so a hanging backend costs little test time
LOSS = MetricDescriptor("train/loss")
RUN = RunInfo(run_id="faults")


CLOSE_LIMIT_S = 60.0
"""How long a close() whose own timeout is seconds may take before the test calls it a hang: its
backend stays broken for the whole test, so a close() that returned at all was ended by its own
timeout, not by the backend (no race with the clock on a loaded machine)."""


def returns_while_broken(close: Callable[[], object], what: str) -> None:
    """Call `close` on a thread; fail unless it returns while the backend is still broken."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (close(), done.set()), name="test-close", daemon=True)
    thread.start()
    assert done.wait(CLOSE_LIMIT_S), f"{what} did not return while its backend stayed broken"
    thread.join()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.01)


class Backend:
    """A real backend behind a fault proxy, the exporter that pushes to it, and what it holds."""

    def __init__(self, kind: str, proxy: FaultProxy, exporter: Exporter, peer: Any) -> None:
        self.kind = kind
        self.proxy = proxy
        self.exporter = exporter
        self.peer = peer

    @property
    def name(self) -> str:
        return self.exporter.name

    def latest(self) -> dict[str, float] | None:
        """Step, loss and this exporter's exported health counters of the newest report the backend holds."""
        if self.kind == "pushgateway":
            found = {
                family.name: family
                for family in text_string_to_metric_families(http_get(f"{self.peer.url}/metrics").decode())
            }
            if "torchtelemetry_train_step" not in found:
                return None

            def value(family: str, **labels: str) -> float:
                (sample,) = [s for s in found[family].samples if labels.items() <= s.labels.items()]
                return sample.value

            mine = {"exporter": self.name}
            return {
                "step": value("torchtelemetry_train_step"),
                "loss": value("torchtelemetry_train_loss"),
                "errors": value("torchtelemetry_exporter_errors", **mine),
                "dropped": value("torchtelemetry_exporter_dropped_reports", **mine),
            }
        received = self.peer.received
        if not received:
            return None
        metrics = metrics_by_name(received[-1].request)

        def counter(name: str) -> float:
            points = metrics[name].sum.data_points
            return {attributes(p.attributes)["exporter"]: p.as_double for p in points}[self.name]

        return {
            "step": metrics["train.step"].gauge.data_points[0].as_int,
            "loss": metrics["train.loss"].gauge.data_points[0].as_double,
            "errors": counter("exporter.errors"),
            "dropped": counter("exporter.dropped_reports"),
        }

    def steps(self) -> list[int]:
        """Every step received, in order (OTLP receivers keep each request)."""
        return [
            metrics_by_name(r.request)["train.step"].gauge.data_points[0].as_int for r in self.peer.received
        ]


@pytest.fixture(params=["pushgateway", "otlp-http", "otlp-grpc"])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)
    kind = request.param
    if kind == "pushgateway":
        peer: Any = request.getfixturevalue("pushgateway")  # skips without the binary
    elif kind == "otlp-http":
        peer = OtlpHttpReceiver()
    else:
        peer = OtlpGrpcReceiver()
    if kind != "pushgateway":
        peer.start()
    try:
        with FaultProxy(peer.port) as proxy:
            if kind == "pushgateway":
                exporter: Exporter = PushgatewayExporter(proxy.url, timeout_s=TIMEOUT_S)
            elif kind == "otlp-http":
                exporter = OTelExporter(endpoint=f"{proxy.url}/v1/metrics", timeout_s=TIMEOUT_S, name=kind)
            else:
                exporter = OTelExporter(protocol="grpc", endpoint=proxy.url, timeout_s=TIMEOUT_S, name=kind)
            yield Backend(kind, proxy, exporter, peer)
    finally:
        if kind != "pushgateway":
            peer.stop()


@pytest.fixture
def hub(backend: Backend) -> Iterator[ExportHub]:
    hub = ExportHub([backend.exporter], run=RUN, queue_size=QUEUE)
    yield hub
    hub.close(5)


def burst(hub: ExportHub, steps: range) -> None:
    """Submit one report per step as fast as possible, on a thread that must finish: submit never waits."""
    submitter = threading.Thread(
        target=lambda: [hub.submit(step, {"train/loss": float(step)}) for step in steps], name="submitter"
    )
    submitter.start()
    submitter.join(30)
    assert not submitter.is_alive(), "submit() blocked"


def accounted(hub: ExportHub, name: str) -> int:
    health = hub.health()[name]
    return health.exported_reports + health.errors + health.dropped_reports


def assert_queue_bound(hub: ExportHub, name: str, submitted: int) -> None:
    """At most one report in flight and `QUEUE` queued: everything else is already counted."""
    assert accounted(hub, name) >= submitted - QUEUE - 1


def settle(hub: ExportHub, name: str, submitted: int) -> None:
    """Wait until every submitted report is exported, failed or dropped."""
    wait_until(lambda: accounted(hub, name) == submitted, what=f"all {submitted} reports accounted for")


def recover(hub: ExportHub, backend: Backend, first_step: int) -> int:
    """Submit a report per step until one arrives (a gRPC channel may need a retry); return that step."""
    step, deadline = first_step, time.monotonic() + 60
    while True:
        hub.submit(step, {"train/loss": float(step)})
        hub.force_flush(10)
        latest = backend.latest()
        if latest is not None and latest["step"] == step:
            return step
        assert time.monotonic() < deadline, f"no report arrived after {backend.kind} came back"
        step += 1


def assert_recovered(hub: ExportHub, backend: Backend, first_step: int) -> None:
    """Reports after recovery arrive, in order, and carry the hub's final error and drop counts."""
    step = recover(hub, backend, first_step)
    for later in (step + 1, step + 2):
        hub.submit(later, {"train/loss": float(later)})
        assert hub.force_flush(10)
        assert backend.latest()["step"] == later
    if backend.kind != "pushgateway":
        assert backend.steps()[-3:] == [step, step + 1, step + 2]
    health = hub.health()[backend.name]
    latest = backend.latest()
    assert latest["loss"] == float(step + 2)
    assert (latest["errors"], latest["dropped"]) == (health.errors, health.dropped_reports)


# -- push backends ------------------------------------------------------------------------


def test_backend_absent_from_start_then_back(backend: Backend, hub: ExportHub) -> None:
    backend.proxy.down()
    hub.describe([LOSS])
    burst(hub, range(1, 13))
    assert_queue_bound(hub, backend.name, 12)
    settle(hub, backend.name, 12)
    health = hub.health()[backend.name]
    assert health.exported_reports == 0 and health.errors >= 1
    assert health.last_success_timestamp is None
    assert not hub.force_flush(5)  # nothing delivered: flush says so
    assert backend.latest() is None

    backend.proxy.up()
    assert_recovered(hub, backend, 13)
    assert hub.health()[backend.name].errors >= health.errors


@pytest.mark.parametrize("fault", ["down", "hang"])
def test_backend_gone_or_hanging_mid_run_then_back(backend: Backend, hub: ExportHub, fault: str) -> None:
    hub.describe([LOSS])
    for step in (1, 2, 3):
        hub.submit(step, {"train/loss": float(step)})
    assert hub.force_flush(10)
    assert backend.latest()["step"] == 3
    # Up to here the backend is healthy, though on a loaded host one push may outlast the 0.5 s
    # timeout (the flush delivered it): what the fault changes is counted from here.
    before = hub.health()[backend.name]

    accepted = backend.proxy.accepted
    getattr(backend.proxy, fault)()
    burst(hub, range(4, 34))
    assert_queue_bound(hub, backend.name, 33)
    settle(hub, backend.name, 33)
    health = hub.health()[backend.name]
    assert health.exported_reports == before.exported_reports  # nothing exported while away
    assert health.errors > before.errors
    if fault == "hang":
        assert backend.proxy.accepted > accepted  # the exporter really reached the black hole
        assert health.dropped_reports >= 1  # each export waits out its timeout: the burst overflows
    assert backend.latest()["step"] == 3  # nothing new arrived while the backend was away

    backend.proxy.up()
    assert_recovered(hub, backend, 34)


def test_slow_backend_gets_the_newest_report(backend: Backend, hub: ExportHub) -> None:
    hub.describe([LOSS])
    backend.proxy.slow(TIMEOUT_S / 10)  # answers late, well within the exporter's timeout (load-proof)
    burst(hub, range(1, 21))
    assert_queue_bound(hub, backend.name, 20)
    assert hub.force_flush(30)
    settle(hub, backend.name, 20)
    health = hub.health()[backend.name]
    assert health.errors == 0
    assert health.exported_reports + health.dropped_reports == 20
    latest = backend.latest()
    assert latest["step"] == 20  # the queue drops the oldest: the newest report is never the one lost
    assert latest["dropped"] == health.dropped_reports  # the queue had not dropped more after step 20 left it


def test_backend_slower_than_the_timeout_is_counted(backend: Backend, hub: ExportHub) -> None:
    hub.describe([LOSS])
    backend.proxy.slow(TIMEOUT_S * 4)  # every answer comes after the exporter gave up
    burst(hub, range(1, 4))
    settle(hub, backend.name, 3)
    health = hub.health()[backend.name]
    assert health.exported_reports == 0 and health.errors >= 1
    backend.proxy.up()
    assert_recovered(hub, backend, 4)


@pytest.mark.parametrize("fault", ["down", "hang", "slow"])
def test_close_returns_within_its_timeout(backend: Backend, fault: str) -> None:
    threads_before = set(threading.enumerate())
    hub = ExportHub([backend.exporter], run=RUN, queue_size=QUEUE)
    hub.describe([LOSS])
    if fault == "slow":
        backend.proxy.slow(10 * CLOSE_LIMIT_S)  # no answer arrives while the test runs
    else:
        getattr(backend.proxy, fault)()
    burst(hub, range(1, 11))
    returns_while_broken(lambda: hub.close(1.0), f"close(1.0) with the backend {fault}")
    # An exporter thread abandoned mid-export finishes within the exporter's timeout; every report is
    # then counted, and no exporter thread is left behind.
    settle(hub, backend.name, 10)
    wait_until(
        lambda: (
            not any(
                t.name.startswith("torchtelemetry-export-")
                for t in set(threading.enumerate()) - threads_before
            )
        ),
        what="exporter threads gone",
    )
    assert hub.health()[backend.name].exported_reports == 0


@pytest.mark.parametrize("backend", ["otlp-http", "otlp-grpc"], indirect=True)
def test_otel_keeps_only_the_newest_failed_report(backend: Backend, hub: ExportHub) -> None:
    hub.describe([LOSS])
    hub.submit(1, {"train/loss": 1.0})
    assert hub.force_flush(10)
    backend.proxy.down()
    for step in range(2, 11):
        hub.submit(step, {"train/loss": float(step)})
        settle(hub, backend.name, step)  # each report reaches the exporter and fails
    assert hub.health()[backend.name].errors == 9
    backend.proxy.up()
    wait_until(lambda: hub.force_flush(10), what="the kept report delivered")
    assert backend.steps() == [1, 10]  # one failed report kept (the newest), not a backlog of nine


# -- the Prometheus scrape endpoint: its "backend" is the scraper -------------------------


def test_hung_and_slow_scrapers_never_block_exports() -> None:
    ranks = [str(rank) for rank in range(4000)]  # a large exposition, so a scraper that stops reading
    descriptor = MetricDescriptor("train/step_time", label_name="rank")  # blocks the server's write
    exporter = PrometheusExporter(port=0)
    hub = ExportHub([exporter], run=RUN, queue_size=QUEUE)
    hub.describe([descriptor])
    hub.submit(0, {"train/step_time": dict.fromkeys(ranks, 0.0)})
    assert hub.force_flush(30)
    scrapers = []
    try:
        for _ in range(3):  # connected, request never finished
            scraper = socket.create_connection(("127.0.0.1", exporter.port), timeout=5)
            scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            scrapers.append(scraper)
        for _ in range(3):  # request sent, response never read
            scraper = socket.socket()
            scraper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            scraper.connect(("127.0.0.1", exporter.port))
            scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            scrapers.append(scraper)
        gone = socket.create_connection(("127.0.0.1", exporter.port), timeout=5)  # leaves mid-response
        gone.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        gone.recv(100)
        gone.close()

        for step in range(1, 31):
            hub.submit(step, {"train/step_time": dict.fromkeys(ranks, float(step))})
        assert hub.force_flush(30)
        health = hub.health()["prometheus"]
        assert health.errors == 0
        assert health.exported_reports + health.dropped_reports == 31
        found = {f.name: f for f in text_string_to_metric_families(http_get(exporter.url).decode())}
        assert found["torchtelemetry_train_step"].samples[0].value == 30  # a working scraper sees the newest
        assert {s.value for s in found["torchtelemetry_train_step_time"].samples} == {30.0}

        returns_while_broken(lambda: hub.close(2.0), "close(2.0) with every stuck scraper still connected")
        with pytest.raises(OSError):
            http_get(f"http://127.0.0.1:{exporter.port}/metrics", timeout_s=2)
    finally:
        for scraper in scrapers:
            scraper.close()


# -- W&B offline: its "backend" is the local W&B service process --------------------------


def _wandb_service_pids() -> list[int]:
    """The W&B service processes this process started (children named wandb-core)."""
    pids = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                if b"wandb-core" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                continue
    return pids


def _wandb_service_killed(rank: int, world_size: int, wandb_dir: str) -> dict[str, Any]:
    """In a fresh process (a killed W&B service breaks W&B's process-wide state): kill it mid-run."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtelemetry").addHandler(handler)
    logging.getLogger("torchtelemetry").setLevel(logging.INFO)
    hub = ExportHub([WandbExporter("faults", dir=wandb_dir)], run=RUN, queue_size=QUEUE)
    hub.describe([LOSS])
    for step in (1, 2, 3):
        hub.submit(step, {"train/loss": float(step)})
    flushed = hub.force_flush(30)
    exported_before = hub.health()["wandb"].exported_reports
    (pid,) = _wandb_service_pids()
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):  # W&B may reap its service itself
        os.waitpid(pid, 0)
    for step in range(4, 34):
        hub.submit(step, {"train/loss": float(step)})
    bound_holds = accounted(hub, "wandb") >= 33 - QUEUE - 1
    hub.force_flush(10)
    returns_while_broken(lambda: hub.close(5.0), "close(5.0) with the W&B service killed")
    health = hub.health()["wandb"]
    return {
        "flushed": flushed,
        "exported_before": exported_before,
        "bound_holds": bound_holds,
        "health": (health.exported_reports, health.errors, health.dropped_reports),
        "messages": messages,
    }


def test_wandb_service_killed_mid_run(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    (result,) = run_ranks(_wandb_service_killed, 1, str(tmp_path), env=env, timeout_s=120)
    assert result["flushed"] and result["exported_before"] == 3
    assert result["bound_holds"]
    exported, errors, dropped = result["health"]
    assert exported == 3 and errors >= 1 and exported + errors + dropped == 33
    failures = [m for m in result["messages"] if "run.log failed" in m]
    assert len(failures) == 1, failures  # one log line for the whole burst of failures, not one per report


# -- the Telemetry façade: the training loop never waits for a dead backend -------------------


def test_training_loop_never_waits_for_dead_backends(pushgateway: PushgatewayServer) -> None:
    with FaultProxy(pushgateway.port) as hanging_gateway, FaultProxy() as black_hole, FaultProxy() as closed:
        hanging_gateway.hang()
        closed.down()
        prometheus = PrometheusExporter(port=0)
        exporters: list[Exporter] = [
            prometheus,
            PushgatewayExporter(hanging_gateway.url, timeout_s=TIMEOUT_S),
            OTelExporter(protocol="grpc", endpoint=black_hole.url, timeout_s=TIMEOUT_S, name="otlp-grpc"),
            OTelExporter(endpoint=f"{closed.url}/v1/metrics", timeout_s=TIMEOUT_S, name="otlp-http"),
        ]
        metrics = {"tokens": tt.SumMetric(kind="counter")}
        telemetry = tt.Telemetry(metrics, exporters, every=1, queue_size=2, signals=False, run_id="loop")
        for step in range(1, 41):
            metrics["tokens"].update(torch.tensor(10.0))
            telemetry.step(step)
        assert not telemetry.flush(timeout_s=1.0)  # collected and submitted; the dead exporters cannot flush
        failing = ("pushgateway", "otlp-grpc", "otlp-http")
        wait_until(lambda: all(telemetry.hub.health()[name].errors for name in failing))
        metrics["tokens"].update(torch.tensor(10.0))
        telemetry.step(41)  # this report carries the failures to the working backend
        telemetry.flush(timeout_s=1.0)
        health = telemetry.hub.health()
        assert health["prometheus"].errors == 0
        assert health["prometheus"].exported_reports + health["prometheus"].dropped_reports == 41
        for name in failing:
            assert health[name].exported_reports == 0
            assert health[name].errors >= 1
        for name in ("pushgateway", "otlp-grpc"):  # each export waits out its timeout: drops follow
            assert health[name].dropped_reports >= 1
        assert hanging_gateway.accepted >= 1 and black_hole.accepted >= 1
        # A working backend shows the failing ones' counts in the exported health metrics.
        found = {f.name: f for f in text_string_to_metric_families(http_get(prometheus.url).decode())}
        assert found["torchtelemetry_train_step"].samples[0].value == 41  # the newest report is never dropped
        assert found["torchtelemetry_tokens"].samples[0].value == 410.0
        errors = {s.labels["exporter"]: s.value for s in found["torchtelemetry_exporter_errors"].samples}
        dropped = {
            s.labels["exporter"]: s.value for s in found["torchtelemetry_exporter_dropped_reports"].samples
        }
        assert errors["prometheus"] == 0 and errors["otlp-http"] >= 1 and errors["pushgateway"] >= 1
        assert dropped["pushgateway"] >= 1
        returns_while_broken(lambda: telemetry.close(timeout_s=2.0), "Telemetry.close(2.0), backends dead")
