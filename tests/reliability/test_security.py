"""Security: loopback-only scrape endpoint, mutual TLS, secrets kept out of logs and labels, escaping."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import torchtelemetry as tt
from tests.faults import FaultProxy
from tests.receivers import (
    OtlpGrpcReceiver,
    OtlpHttpReceiver,
    attributes,
    metrics_by_name,
    resource_attributes,
    wait_for_wandb_logs,
)
from tests.servers import PushgatewayServer, http_get, self_signed_cert
from torchtelemetry.export import (
    ExportHub,
    ExportResult,
    MetricDescriptor,
    OTelExporter,
    PrometheusExporter,
    PushgatewayExporter,
    RunInfo,
    exporters_from_spec,
    redact_url,
)

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")

STEP_TIME = MetricDescriptor("train/step_time", unit="seconds", label_name="rank")
LOSS = MetricDescriptor("train/loss")


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("OTEL_"):
            monkeypatch.delenv(key)


# -- where the scrape endpoint listens ------------------------------------------------------


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def non_loopback_addresses() -> set[str]:
    """This machine's IPv4 addresses outside 127/8 (the route to a public address; no packet is sent)."""
    found = set()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
        found.add(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    return {address for address in found if not address.startswith("127.") and address != "0.0.0.0"}


def test_scrape_endpoint_binds_loopback_unless_told_otherwise() -> None:
    default = PrometheusExporter(port=0)
    (from_spec,) = exporters_from_spec("prometheus", prometheus={"port": 0})
    wide = PrometheusExporter(port=0, addr="0.0.0.0", name="wide")
    try:
        for exporter in (default, from_spec, wide):
            exporter.start()
        for exporter in (default, from_spec):
            assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
            assert reachable("127.0.0.1", exporter.port)
            assert not reachable("127.0.0.2", exporter.port)  # another local address: refused
            for address in non_loopback_addresses():
                assert not reachable(address, exporter.port), address
        assert reachable("127.0.0.2", wide.port)  # the check sees a wider bind when one is asked for
    finally:
        for exporter in (default, from_spec, wide):
            exporter.close()


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(tmp_path: Path) -> None:
    server_cert, server_key = self_signed_cert(tmp_path / "server")
    client_cert, client_key = self_signed_cert(tmp_path / "client")
    stranger_cert, stranger_key = self_signed_cert(tmp_path / "stranger")
    exporter = PrometheusExporter(
        port=0,
        certfile=str(server_cert),
        keyfile=str(server_key),
        client_cafile=str(client_cert),
        client_auth_required=True,
    )
    try:
        exporter.describe([LOSS], RunInfo(run_id="tls"))
        assert exporter.export(3, {"train/loss": 0.5}, 1.0) is ExportResult.SUCCESS

        def scrape(cert: Path | None, key: Path | None, trust: Path | None = server_cert) -> bytes:
            context = ssl.create_default_context(cafile=str(trust) if trust else None)
            if cert is not None:
                context.load_cert_chain(str(cert), str(key))
            with urllib.request.urlopen(exporter.url, timeout=5, context=context) as response:
                return response.read()

        body = scrape(client_cert, client_key).decode()
        assert 'torchtelemetry_train_loss{route="scrape",run="tls"} 0.5' in body
        for cert, key in ((None, None), (stranger_cert, stranger_key)):
            with pytest.raises(OSError):  # handshake refused (ssl.SSLError / connection reset)
                scrape(cert, key)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(client_cert, client_key, trust=None)  # the server's certificate is really checked
    finally:
        exporter.close()


# -- secrets ----------------------------------------------------------------------------------

SECRETS = {
    "wandb": "0123456789abcdef0123456789abcdef0badc0de",
    "bearer": "bearer-s3cr3t-7f1c",
    "url_password": "url-pa55word-9e2d",
    "gateway_password": "gw-pa55word-41aa",
}


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    wandb = pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    for key, value in {**env, "WANDB_DIR": str(wandb_dir), "WANDB_API_KEY": SECRETS["wandb"]}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    yield wandb_dir
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def test_no_secret_in_logs_stderr_or_exported_labels(
    wandb_offline: Path,
    pushgateway: PushgatewayServer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the SDKs' and urllib3's included
    bearer = {"Authorization": f"Bearer {SECRETS['bearer']}"}
    user_info = f"trainer:{SECRETS['url_password']}@"
    with (
        OtlpHttpReceiver() as http_receiver,
        OtlpGrpcReceiver() as grpc_receiver,
        FaultProxy() as black_hole,
        FaultProxy() as closed,
    ):
        closed.down()
        prometheus = PrometheusExporter(port=0)
        exporters = [
            prometheus,
            tt.WandbExporter("security"),
            OTelExporter(
                endpoint=http_receiver.metrics_endpoint,
                headers=bearer,
                timeout_s=1,
                name="otlp-http",
            ),
            OTelExporter(protocol="grpc", endpoint=grpc_receiver.endpoint, headers=bearer, name="otlp-grpc"),
            OTelExporter(  # failing: the error paths log too
                endpoint=f"http://{user_info}{closed.address}/v1/metrics",
                headers=bearer,
                timeout_s=0.5,
                name="otlp-down",
            ),
            OTelExporter(
                protocol="grpc", endpoint=black_hole.url, headers=bearer, timeout_s=0.5, name="otlp-hang"
            ),
            PushgatewayExporter(pushgateway.url.replace("http://", f"http://{user_info}"), timeout_s=1),
            PushgatewayExporter(
                f"http://{user_info}{closed.address}", timeout_s=0.5, name="pushgateway-down"
            ),
        ]
        hub = ExportHub(exporters, run=RunInfo(run_id="secrets"))
        hub.describe([LOSS, STEP_TIME])
        for step in (1, 2, 3):
            hub.submit(step, {"train/loss": 1.0 / step, "train/step_time": {"0": 0.25}})
        hub.force_flush(10)
        exposition = http_get(prometheus.url)
        gateway_metrics = http_get(f"{pushgateway.url}/metrics")
        hub.close(10)
        health = hub.health()
        # The working backends got every report, with the credentials where they belong.
        for name in ("prometheus", "wandb", "otlp-http", "otlp-grpc", "pushgateway"):
            assert (health[name].exported_reports, health[name].errors) == (3, 0), name
        for name in ("otlp-down", "otlp-hang", "pushgateway-down"):
            assert health[name].errors >= 1, name
        http_request = http_receiver.received[-1]
        assert http_request.headers["authorization"] == f"Bearer {SECRETS['bearer']}"
        assert grpc_receiver.received[-1].headers["authorization"] == f"Bearer {SECRETS['bearer']}"
        requests = [r.request for r in (*http_receiver.received, *grpc_receiver.received)]
    wait_for_wandb_logs(wandb_offline, 1)
    captured = capfd.readouterr()
    exported_files = b"".join(path.read_bytes() for path in wandb_offline.rglob("*") if path.is_file())
    places = {
        "logs": caplog.text,
        "stdout": captured.out,
        "stderr": captured.err,
        "exporter reprs": " ".join(repr(e) + str(getattr(e, "url", "")) for e in exporters),
        "Prometheus exposition": exposition.decode(),
        "Pushgateway metrics": gateway_metrics.decode(),
        "OTLP payloads (resource and point attributes)": " ".join(str(request) for request in requests),
        "W&B run files": exported_files.decode(errors="replace"),
    }
    assert "OTLP" in caplog.text and "Pushgateway" in caplog.text  # the failures were logged ...
    for place, text in places.items():
        for what, secret in SECRETS.items():
            assert secret not in text, f"the {what} secret appears in {place}"  # ... without secrets


@contextlib.contextmanager
def _every_sdk_line() -> Iterator[None]:
    """The OpenTelemetry SDK's loggers without their filters for a while: its DuplicateFilter drops a
    line equal to the last one it let through in the same 20 s (process-wide), so an earlier test's
    identical export failure would hide this test's."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("opentelemetry")
    ]
    filters = {logger: list(logger.filters) for logger in loggers}
    for logger, kept in filters.items():
        for each in kept:
            logger.removeFilter(each)
    try:
        yield
    finally:
        for logger, kept in filters.items():
            for each in kept:
                logger.addFilter(each)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_otel_sdk_logs_no_secret_at_warning_with_the_collector_down(protocol: str) -> None:
    """Every WARNING-and-above line of every logger (the library's, the OpenTelemetry SDK's,
    urllib3's and grpc's) while pushes fail against a collector that is down: the endpoint's user
    information and the header token never appear; a query-string token is refused before any push."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    bearer = {"Authorization": f"Bearer {SECRETS['bearer']}"}
    try:
        with FaultProxy() as closed, _every_sdk_line():
            closed.down()
            with pytest.raises(ValueError, match="has a query") as refused:
                OTelExporter(protocol=protocol, endpoint=f"http://{closed.address}/v1/metrics?api_key=qu3ry")
            user_info = f"trainer:{SECRETS['url_password']}@" if protocol == "http/protobuf" else ""
            path = "/v1/metrics" if protocol == "http/protobuf" else ""
            exporter = OTelExporter(
                protocol=protocol,
                endpoint=f"http://{user_info}{closed.address}{path}",
                headers=bearer,
                timeout_s=1,
            )
            exporter.describe([LOSS], RunInfo(run_id="down"))
            for step in (1, 2):
                assert exporter.export(step, {"train/loss": 1.0}, 1.0) is ExportResult.FAILURE
            exporter.close(1)
    finally:
        root.removeHandler(handler)
    assert "qu3ry" not in str(refused.value)
    lines = [f"{record.name}: {record.getMessage()}" for record in records]
    assert any(line.startswith("opentelemetry") for line in lines), lines  # the SDK's own lines
    for line in lines:
        for what, secret in SECRETS.items():
            assert secret not in line, f"the {what} secret in: {line}"


TOKEN = "tok3n-from-a-file"


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ({"headers": {"Authorization": f"Bearer {TOKEN}\n"}}, "the value of header 'Authorization'"),
        ({"headers": {"Authorization": f" Bearer {TOKEN}"}}, "headers=: the value of header 'Authorization'"),
        ({"headers": {"Authorization": f"Bearer {TOKEN}\u00e9"}}, "the value of header 'Authorization'"),
        (
            {"env": {"OTEL_EXPORTER_OTLP_HEADERS": f"Authorization=Bearer%20{TOKEN}%0D%0AX-Evil=1"}},
            "OTEL_EXPORTER_OTLP_HEADERS: the value of header 'Authorization'",
        ),
        (
            {"env": {"OTEL_EXPORTER_OTLP_METRICS_HEADERS": f"Authorization=Bearer {TOKEN};v=1"}},
            "OTEL_EXPORTER_OTLP_METRICS_HEADERS: header 'Authorization' is not a name=value pair",
        ),
        (
            {"env": {"OTEL_EXPORTER_OTLP_HEADERS": f"Bearer {TOKEN}"}},
            "OTEL_EXPORTER_OTLP_HEADERS: header entry 1 is not a name=value pair",
        ),
    ],
    ids=["trailing newline", "leading space", "non-ASCII", "encoded CRLF", "semicolon in env", "no name"],
)
def test_a_header_the_transport_cannot_send_is_refused_naming_it_never_its_value(
    protocol: str,
    given: dict[str, Any],
    refused: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger at every level: the SDK's and urllib3's too
    for key, value in given.get("env", {}).items():
        monkeypatch.setenv(key, value)
    receiver_type = OtlpGrpcReceiver if protocol == "grpc" else OtlpHttpReceiver
    with receiver_type() as receiver:
        endpoint = receiver.endpoint if protocol == "grpc" else receiver.metrics_endpoint
        error = None
        try:  # refused here; without the check the SDK logs the token at the first push
            exporter = OTelExporter(
                protocol=protocol, endpoint=endpoint, headers=given.get("headers"), timeout_s=1
            )
        except ValueError as caught:
            error = str(caught)
        else:
            exporter.describe([LOSS], RunInfo(run_id="header"))
            exporter.export(1, {"train/loss": 1.0}, time.time())
            exporter.close(1)
    captured = capfd.readouterr()
    for place, text in {"logs": caplog.text, "stderr": captured.err, "stdout": captured.out}.items():
        assert TOKEN not in text, f"the token appears in {place}"
    assert error is not None and refused in error, error
    assert TOKEN not in error and "value is not shown" in error


class AuthPushgateway(PushgatewayServer):
    """A Pushgateway that requires HTTP basic auth (exporter-toolkit web config, bcrypt password)."""

    def __init__(self, workdir: Path, user: str, password: str) -> None:
        super().__init__(workdir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            crypt = pytest.importorskip("crypt")
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
        if not hashed or not hashed.startswith("$2"):
            pytest.skip("no bcrypt in this libc's crypt()")
        self._web_config = self.workdir / "web.yml"
        self._web_config.write_text(json.dumps({"basic_auth_users": {user: hashed}}))
        self._authorization = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def _command(self) -> list[str]:
        return [*super()._command(), f"--web.config.file={self._web_config}"]

    def get(self, path: str) -> bytes:
        request = urllib.request.Request(self.url + path, headers={"Authorization": self._authorization})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read()

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._process is not None and self._process.poll() is None:
            try:
                self.get(self.ready_path)
                return True
            except OSError:
                time.sleep(0.1)
        return False


def test_pushgateway_credentials_in_the_url_are_basic_auth_and_never_logged(
    tmp_path: Path, pushgateway: PushgatewayServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = SECRETS["gateway_password"]
    with AuthPushgateway(tmp_path / "auth-gateway", "trainer", password) as gateway:
        good = PushgatewayExporter(f"http://trainer:{password}@{gateway.address}", timeout_s=5)
        wrong = PushgatewayExporter(f"http://trainer:not-{password}@{gateway.address}", name="wrong")
        assert good.url == wrong.url == gateway.url  # credentials are not part of the address
        hub = ExportHub([good, wrong], run=RunInfo(run_id="basic-auth"))
        hub.describe([LOSS])
        hub.submit(1, {"train/loss": 0.25})
        hub.force_flush(10)
        health = hub.health()
        assert (health["pushgateway"].exported_reports, health["wrong"].errors) == (1, 1)
        body = gateway.get("/metrics").decode()
        labels = 'instance="",job="torchtelemetry",route="pushgateway",run="basic-auth"'
        assert f"torchtelemetry_train_loss{{{labels}}} 0.25" in body
        with pytest.raises(urllib.error.HTTPError, match="401"):
            http_get(f"{gateway.url}/metrics")  # the gateway really requires the credentials
        hub.close(10)
    assert "401" in caplog.text  # the refusal is logged ...
    assert password not in caplog.text  # ... the password never is


# -- label values: escaped in the exposition, intact over OTLP ----------------------------------

AWKWARD = {
    'quote "q"': 1.0,
    "back\\slash": 2.0,
    "new\nline": 3.0,
    "ünïcødé ✓ 日本": 4.0,
    'all "\\\n of them': 5.0,
}
AWKWARD_RUN = 'run "7"\\n\nü'


def _by_label(samples: Any, name: str) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in samples if s.name == name}


def test_awkward_label_values_round_trip_through_the_exposition(promtool: str) -> None:
    exporter = PrometheusExporter(port=0)
    hub = ExportHub([exporter], run=RunInfo(run_id=AWKWARD_RUN))
    try:
        hub.describe([STEP_TIME])
        hub.submit(1, {"train/step_time": AWKWARD})
        assert hub.force_flush(10)
        body = http_get(exporter.url)
        found = {f.name: f for f in text_string_to_metric_families(body.decode())}
        samples = found["torchtelemetry_train_step_time_seconds"].samples
        assert _by_label(samples, "torchtelemetry_train_step_time_seconds") == AWKWARD
        assert {s.labels["run"] for f in found.values() for s in f.samples} == {AWKWARD_RUN}
        checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
        assert (checked.returncode, checked.stdout + checked.stderr) == (0, b"")
    finally:
        hub.close(10)


def test_awkward_label_values_and_run_id_through_the_pushgateway(pushgateway: PushgatewayServer) -> None:
    run_id = AWKWARD_RUN + "/with/slashes"  # a grouping-key value with "/" travels base64-encoded
    exporter = PushgatewayExporter(pushgateway.url, timeout_s=30, keep_on_close=False)  # a loaded host's
    exporter.describe([STEP_TIME], RunInfo(run_id=run_id))
    assert exporter.export(1, {"train/step_time": AWKWARD}, 1.0) is ExportResult.SUCCESS
    assert {"job": "torchtelemetry", "run": run_id} in pushgateway.groups()
    found = {
        f.name: f for f in text_string_to_metric_families(http_get(f"{pushgateway.url}/metrics").decode())
    }
    family = found["torchtelemetry_train_step_time_seconds"]
    samples = [s for s in family.samples if s.labels["run"] == run_id]
    assert _by_label(samples, "torchtelemetry_train_step_time_seconds") == AWKWARD
    exporter.close(30)
    assert pushgateway.groups_once_deleted(run_id) == []


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_awkward_label_values_arrive_intact_over_otlp(protocol: str) -> None:
    receiver: Any = OtlpGrpcReceiver() if protocol == "grpc" else OtlpHttpReceiver()
    with receiver:
        endpoint = receiver.endpoint if protocol == "grpc" else receiver.metrics_endpoint
        exporter = OTelExporter(protocol=protocol, endpoint=endpoint, timeout_s=5)
        exporter.describe([STEP_TIME], RunInfo(run_id=AWKWARD_RUN))
        assert exporter.export(1, {"train/step_time": AWKWARD}, 1.0) is ExportResult.SUCCESS
        exporter.close(5)
        (received,) = receiver.received
    points = metrics_by_name(received.request)["train.step_time"].gauge.data_points
    assert {attributes(p.attributes)["rank"]: p.as_double for p in points} == AWKWARD
    assert resource_attributes(received.request)[0]["service.instance.id"] == AWKWARD_RUN


@pytest.mark.parametrize(
    ("url", "logged"),
    [
        (
            "https://u:p4ss@otlp.example:4318/v1/metrics?api_key=S3CR3T&tenant=a",
            "https://***@otlp.example:4318/v1/metrics?api_key=***&tenant=***",
        ),
        ("otlp.example:4317", "otlp.example:4317"),
        ("http://127.0.0.1:9091", "http://127.0.0.1:9091"),
        ("http://gw/?S3CR3T#S3CR3T", "http://gw/?***#***"),
        ("http://gw/?e=someone@example.org", "http://gw/?e=***"),
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
    ],
)
def test_one_helper_masks_the_secrets_of_any_logged_url(url: str, logged: str) -> None:
    assert redact_url(url) == logged
