"""Real Prometheus and Pushgateway servers for tests: 127.0.0.1, free ports, temp dirs. No pytest needed.

    with PrometheusServer(tmp_path / "prometheus") as prometheus:       # 1 s scrape interval
        prometheus.scrape("trainer", ["127.0.0.1:9464"])               # add a job, reload, wait for it
        samples = prometheus.wait_for('torchtelemetry_train_step >= 3')  # poll /api/v1/query
        samples[0].value, samples[0].labels["run"]

    with PushgatewayServer(tmp_path / "gateway") as gateway:
        gateway.url, gateway.address, gateway.groups()

    agent = PrometheusServer(tmp_path / "agent", agent=True)           # agent mode: no local queries
    agent.scrape("pushgateway", [gateway.address], honor_labels=True)
    with VictoriaMetricsServer(tmp_path / "vm") as vm:
        agent.remote_write(vm.write_url)                                # before start(), or reloads
        agent.start()
        vm.wait_for('torchtelemetry_train_step >= 3')                   # the same query API
        vm.export('{run="..."}')                                        # every raw sample stored

`query(url, expr)` and `wait_for(url, expr)` also work with a bare base URL, for
code running in another process (a rank) that only knows the server's address.
`self_signed_cert(directory)` makes a certificate for 127.0.0.1 with `openssl`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.distributed import free_port

__all__ = [
    "PrometheusServer",
    "PushgatewayServer",
    "QueryError",
    "Sample",
    "VictoriaMetricsServer",
    "binary",
    "http_get",
    "query",
    "self_signed_cert",
    "wait_for",
]


@dataclass(frozen=True)
class Sample:
    """One series of a query result."""

    labels: dict[str, str]
    value: float


class QueryError(RuntimeError):
    """Prometheus rejected a query (bad PromQL) or did not answer."""


def binary(name: str) -> str | None:
    """Path of a server binary (`prometheus`, `prometheus-pushgateway`, `promtool`), None if absent."""
    return shutil.which(name)


def http_get(
    url: str, *, timeout_s: float = 10.0, data: bytes | None = None, method: str | None = None
) -> bytes:
    """Body of an HTTP request; raises `urllib.error.URLError`/`HTTPError` on failure."""
    request = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return response.read()


def query(url: str, expr: str, *, at: float | None = None, timeout_s: float = 10.0) -> list[Sample]:
    """Evaluate `expr` with `/api/v1/query` on the Prometheus at `url` (now, or at Unix time `at`)."""
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    try:
        body = json.loads(
            http_get(f"{url}/api/v1/query?{urllib.parse.urlencode(params)}", timeout_s=timeout_s)
        )
    except urllib.error.HTTPError as error:
        raise QueryError(f"{expr!r}: HTTP {error.code}: {error.read().decode(errors='replace')}") from error
    if body.get("status") != "success":
        raise QueryError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
    data = body["data"]
    if data["resultType"] == "vector":
        return [Sample(entry["metric"], float(entry["value"][1])) for entry in data["result"]]
    if data["resultType"] == "scalar":
        return [Sample({}, float(data["result"][1]))]
    raise QueryError(f"{expr!r}: result type {data['resultType']!r}; use an instant vector expression")


def wait_for(
    url: str,
    expr: str,
    *,
    predicate: Callable[[list[Sample]], bool] | None = None,
    timeout_s: float = 60.0,
    poll_s: float = 0.25,
) -> list[Sample]:
    """Poll `expr` until it returns at least one sample (and `predicate(samples)` holds); return them.

    On timeout raises `TimeoutError` with the last result and the scrape targets' health.
    """
    deadline = time.monotonic() + timeout_s
    samples: list[Sample] = []
    while True:
        try:
            samples = query(url, expr)
        except (OSError, QueryError) as error:
            if isinstance(error, QueryError) and "HTTP 400" in str(error):
                raise
            samples = []
        if samples and (predicate is None or predicate(samples)):
            return samples
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{expr!r} not satisfied within {timeout_s}s; last result {samples}; targets: {_targets(url)}"
            )
        time.sleep(poll_s)


def _targets(url: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(http_get(f"{url}/api/v1/targets?state=active"))["data"]["activeTargets"]
    except (OSError, ValueError, KeyError):
        return []
    return [
        {key: target.get(key) for key in ("scrapePool", "scrapeUrl", "health", "lastError")}
        for target in data
    ]


class _Server:
    """A server process on 127.0.0.1 with a free port; its output goes to `workdir/<name>.log`."""

    name = ""
    ready_path = "/-/ready"

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log = self.workdir / f"{self.name}.log"

    @property
    def address(self) -> str:
        """`127.0.0.1:<port>`."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>`."""
        return f"http://{self.address}"

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 60.0) -> _Server:
        """Start and wait until ready; retries with another port if the chosen one was taken meanwhile."""
        for _attempt in range(3):
            self.port = free_port()
            with self._log.open("ab") as log:
                self._process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
            if self._wait_ready(timeout_s):
                return self
            exited = self._process.poll() is not None
            self.stop()
            if not (exited and "address already in use" in self.log_tail()):
                break
        raise RuntimeError(f"{self.name} did not become ready on {self.address}; log:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._process.poll() is None:
            try:
                http_get(self.url + self.ready_path, timeout_s=2)
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Terminate the process (kill after 10 s); safe to call twice."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self._log.read_text(errors="replace")[-chars:] if self._log.exists() else ""

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusServer(_Server):
    """`prometheus` with a `scrape_interval_s` (default 1 s) scrape, temp storage, lifecycle API on.

    With `agent=True`, Prometheus in agent mode: it scrapes and remote-writes (`remote_write`),
    stores nothing to query (its query API answers no data). `external_labels` go on every series.
    `features` are turned on with `--enable-feature` (`exemplar-storage`: `query_exemplars`).
    """

    name = "prometheus"

    def __init__(
        self,
        workdir: str | Path,
        *,
        scrape_interval_s: float = 1.0,
        agent: bool = False,
        external_labels: dict[str, str] | None = None,
        features: Sequence[str] = (),
    ) -> None:
        super().__init__(workdir)
        self.scrape_interval_s = scrape_interval_s
        self.agent = agent
        self.features = tuple(features)
        self.external_labels = dict(external_labels or {})
        self._jobs: dict[str, dict[str, Any]] = {}
        self._remote_writes: list[dict[str, Any]] = []
        self._config = self.workdir / "prometheus.yml"
        self._write_config()

    def _command(self) -> list[str]:
        path = binary("prometheus")
        if path is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        storage = (
            ["--enable-feature=agent", f"--storage.agent.path={self.workdir / 'wal'}"]
            if self.agent
            else [f"--storage.tsdb.path={self.workdir / 'data'}"]
        )
        return [
            path,
            f"--config.file={self._config}",
            *storage,
            *(f"--enable-feature={feature}" for feature in self.features),
            f"--web.listen-address={self.address}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]

    def _write_config(self) -> None:
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval},
            "scrape_configs": list(self._jobs.values()),
        }
        if not self.agent:  # agent mode evaluates no rules
            config["global"]["evaluation_interval"] = interval
        if self.external_labels:
            config["global"]["external_labels"] = self.external_labels
        if self._remote_writes:
            config["remote_write"] = self._remote_writes
        self._config.write_text(json.dumps(config, indent=1))  # JSON is YAML

    def remote_write(self, url: str, **options: Any) -> None:
        """Send every sample to `url` too (a `remote_write` entry with `options`, e.g. `queue_config`).
        Call it before `start()`."""
        if self._process is not None:
            raise RuntimeError("PrometheusServer.remote_write: call it before start()")
        self._remote_writes.append({"url": url, **options})
        self._write_config()

    def scrape(
        self,
        job: str,
        targets: Sequence[str],
        *,
        honor_labels: bool = False,
        scheme: str = "http",
        tls_config: dict[str, Any] | None = None,
        metrics_path: str = "/metrics",
        timeout_s: float = 30.0,
    ) -> None:
        """Add (or replace) scrape job `job` for `targets` ("host:port").

        Before `start()` this only writes the config (the fastest way: the first
        scrape follows within one interval). On a running server it reloads and
        waits until the job is active; Prometheus applies reloads at most every
        5 s.
        """
        self._jobs[job] = {
            "job_name": job,
            "honor_labels": honor_labels,
            "scheme": scheme,
            "metrics_path": metrics_path,
            "static_configs": [{"targets": list(targets)}],
            **({"tls_config": tls_config} if tls_config else {}),
        }
        self._write_config()
        if self._process is None:
            return
        http_get(f"{self.url}/-/reload", data=b"", method="POST")
        deadline = time.monotonic() + timeout_s
        while {t["scrapeUrl"] for t in _targets(self.url) if t["scrapePool"] == job} != {
            f"{scheme}://{target}{metrics_path}" for target in targets
        }:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job!r} not active after reload; targets: {_targets(self.url)}")
            time.sleep(0.1)

    def query(self, expr: str, **options: Any) -> list[Sample]:
        """`query(self.url, expr, ...)`."""
        return query(self.url, expr, **options)

    def wait_for(self, expr: str, **options: Any) -> list[Sample]:
        """`wait_for(self.url, expr, ...)`."""
        return wait_for(self.url, expr, **options)

    def query_exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        """`/api/v1/query_exemplars` of the series `expr` selects between Unix times `start` and `end`:
        one entry per series, `seriesLabels` and its `exemplars` (`labels`, `value`, `timestamp`)."""
        params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}"})
        body = json.loads(http_get(f"{self.url}/api/v1/query_exemplars?{params}"))
        if body.get("status") != "success":
            raise QueryError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]


class PushgatewayServer(_Server):
    """`prometheus-pushgateway`, in memory only (nothing persisted between servers)."""

    name = "pushgateway"

    def _command(self) -> list[str]:
        path = binary("prometheus-pushgateway") or binary("pushgateway")
        if path is None:
            raise FileNotFoundError(
                "the Pushgateway is not installed (apt-get install prometheus-pushgateway)"
            )
        # Debian's build persists to /var/lib/prometheus by default: keep every test's gateway in memory.
        return [path, f"--web.listen-address={self.address}", "--persistence.file=", "--log.level=warn"]

    def groups(self) -> list[dict[str, str]]:
        """Grouping-key labels of every group the gateway holds (`job` included)."""
        data = json.loads(http_get(f"{self.url}/api/v1/metrics"))["data"]
        return [group["labels"] for group in data]

    def groups_of(self, run_id: str) -> list[dict[str, str]]:
        """The grouping-key labels of the groups of run `run_id`."""
        return [group for group in self.groups() if group.get("run") == run_id]

    def groups_once_deleted(self, run_id: str, timeout_s: float = 15.0) -> list[dict[str, str]]:
        """The groups of run `run_id` the gateway holds once it holds none, or after `timeout_s`: it
        answers a DELETE with 202 and applies it from its write queue later (on a loaded machine,
        after the next read)."""
        deadline = time.monotonic() + timeout_s
        while (held := self.groups_of(run_id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return held


class VictoriaMetricsServer(_Server):
    """Debian's single-node `victoria-metrics`: Prometheus remote write in, the Prometheus query API out.

    Samples are queryable as soon as they are stored (`-search.latencyOffset=0s`; the default hides
    the last 30 s), and responses are not cached, so polling sees new data.
    """

    name = "victoria-metrics"
    ready_path = "/health"

    def _command(self) -> list[str]:
        path = binary("victoria-metrics")
        if path is None:
            raise FileNotFoundError("VictoriaMetrics is not installed (apt-get install victoria-metrics)")
        return [
            path,
            f"-httpListenAddr={self.address}",
            f"-storageDataPath={self.workdir / 'data'}",
            "-retentionPeriod=1d",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=WARN",
        ]

    @property
    def write_url(self) -> str:
        """Where Prometheus remote-writes (`remote_write: [{url: ...}]`)."""
        return f"{self.url}/api/v1/write"

    def query(self, expr: str, **options: Any) -> list[Sample]:
        """`query(self.url, expr, ...)`: VictoriaMetrics answers Prometheus' `/api/v1/query`."""
        return query(self.url, expr, **options)

    def wait_for(self, expr: str, **options: Any) -> list[Sample]:
        """`wait_for(self.url, expr, ...)`."""
        return wait_for(self.url, expr, **options)

    def export(self, selector: str) -> list[dict[str, Any]]:
        """Every stored sample of the series matching `selector`, as VictoriaMetrics' `/api/v1/export`
        gives them: `{"metric": labels, "values": [...], "timestamps": [ms, ...]}` per series."""
        body = http_get(f"{self.url}/api/v1/export?{urllib.parse.urlencode({'match[]': selector})}")
        return [json.loads(line) for line in body.decode().splitlines() if line.strip()]


def self_signed_cert(directory: str | Path, *, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """`(certfile, keyfile)` of a fresh self-signed certificate valid for IP `host`, made with `openssl`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(key), "-out", str(cert),
            "-subj", f"/CN={host}", "-addext", f"subjectAltName=IP:{host}",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
