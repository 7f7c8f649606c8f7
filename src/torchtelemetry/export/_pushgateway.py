"""`PushgatewayExporter`: push each report to a Prometheus Pushgateway, for jobs too short to scrape."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._exposition import (
    ROUTE_LABEL,
    RUN_LABEL,
    PrometheusCollector,
    import_prometheus_client,
)
from torchtelemetry.export._naming import NAMESPACE
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.export._urls import redact_url
from torchtelemetry.report import MetricDescriptor, ReportValues, wall_time

__all__ = ["PushgatewayExporter"]

logger = logging.getLogger(__name__)


class PushgatewayExporter(BaseExporter):
    """Pushes (HTTP PUT, replacing the group) every report to `url` under the grouping key (job, run, ...).

    Pushes run on the exporter's hub thread, each bounded by `timeout_s`. On
    close the final report is pushed once more with
    `torchtelemetry_run_finished_timestamp_seconds`, and the gateway keeps it, so
    Prometheus scrapes the last values and alerts and dashboards tell a finished
    run from a stalled one; `keep_on_close=False` deletes the group instead (the
    final report may then never be scraped). Scrape the gateway with
    `honor_labels: true` so `job` and `run` are kept.
    Credentials in the URL (`https://user:password@host:9091`) are sent as HTTP
    basic auth and kept out of `url`, logs and repr. A query string is refused (the push path
    goes after the address).
    """

    def __init__(
        self,
        url: str,
        *,
        job: str = "torchtelemetry",
        grouping_key: Mapping[str, str] | None = None,
        keep_on_close: bool = True,
        timeout_s: float = 10.0,
        namespace: str = NAMESPACE,
        name: str = "pushgateway",
    ) -> None:
        self._client = import_prometheus_client()
        if not url:
            raise ValueError(
                "PushgatewayExporter.url: must be the gateway address, e.g. http://127.0.0.1:9091"
            )
        if not job:
            raise ValueError("PushgatewayExporter.job: must be a non-empty string")
        reserved = {"job", RUN_LABEL, ROUTE_LABEL} & set(grouping_key or {})
        if reserved:
            raise ValueError(
                f"PushgatewayExporter.grouping_key: {sorted(reserved)} are set by the exporter "
                "(job=, the run id and the route); pass job= instead or leave them out"
            )
        if timeout_s <= 0:
            raise ValueError(f"PushgatewayExporter.timeout_s: must be positive, got {timeout_s}")
        if "?" in url or "#" in url:
            raise ValueError(
                f"PushgatewayExporter.url: {redact_url(url)} has a query or a fragment, which the push "
                "path /metrics/job/... is appended after; pass the gateway's address alone (credentials "
                "as user:password@host)"
            )
        bare_url, self._credentials = _split_credentials(url)
        super().__init__(name, subject=f"PushgatewayExporter {name!r} ({redact_url(bare_url)})")
        self.url = bare_url
        """The gateway address, without credentials."""
        self.job = job
        self.keep_on_close = keep_on_close
        self.timeout_s = timeout_s
        self._extra_key = {str(k): str(v) for k, v in (grouping_key or {}).items()}
        self._grouping_key: dict[str, str] | None = None
        self._namespace = namespace
        self._collector = PrometheusCollector("pushgateway", namespace)
        self._registry = self._client.CollectorRegistry()
        self._registry.register(self._collector)
        self._pending = False
        self._pushed_key: dict[str, str] | None = None

    def reporting_as(self, reporter: str) -> PushgatewayExporter:
        """A copy that pushes to the same gateway, under this grouping key plus `reporter=<reporter>`,
        and deletes its group at close: how a rank other than the exporting one reports a hang of
        the exporting rank without replacing that rank's group (docs/signals.md, Hangs)."""
        copy = PushgatewayExporter(
            self.url,
            job=self.job,
            grouping_key={**self._extra_key, "reporter": reporter},
            keep_on_close=False,
            timeout_s=self.timeout_s,
            namespace=self._namespace,
            name=f"{self.name}-{reporter}",
        )
        copy._credentials = self._credentials
        return copy

    @property
    def grouping_key(self) -> dict[str, str] | None:
        """The grouping key besides `job` (the run id and any extra labels); None before describe."""
        return None if self._grouping_key is None else dict(self._grouping_key)

    def destination(self) -> str | None:
        return redact_url(self.url)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        """Check and learn the names (raises `NameCollisionError`); the run id joins the grouping key."""
        self._collector.set_descriptors(descriptors, run)
        self._grouping_key = {**self._extra_key, RUN_LABEL: run.run_id}
        if self._pushed_key is not None and self._pushed_key != self._grouping_key:
            self._delete(self._pushed_key, self.timeout_s)
            self._pushed_key = None

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """Push this report (replacing the group)."""
        problems = self._collector.set_report(step, values, timestamp)
        if problems:
            raise ExportFailed(f"values left out: {'; '.join(problems)}")
        self._pending = True
        self._push(self.timeout_s)

    def _retire(self, names: frozenset[str]) -> None:
        self._collector.retire(names)

    def _flush(self, timeout_s: float) -> bool:
        """Push again the latest report if its push failed; True when the gateway has it."""
        if self._pending:
            self._push(min(timeout_s, self.timeout_s))
        return True

    def _close(self, timeout_s: float) -> None:
        """Push the final report marked finished (or delete the group: `keep_on_close=False`)."""
        if self._grouping_key is None:
            return
        if self.keep_on_close:
            self._collector.set_finished(wall_time())
            try:
                self._push(min(timeout_s, self.timeout_s))
            except ExportFailed as error:
                logger.warning(
                    "PushgatewayExporter %r: the final report (marked finished) did not reach %s: %s",
                    self.name,
                    self.url,
                    error.__cause__ or error,
                )
            return
        self._delete(self._grouping_key, timeout_s)

    def _delete(self, grouping_key: dict[str, str], timeout_s: float) -> None:
        try:
            self._client.delete_from_gateway(
                self.url,
                job=self.job,
                grouping_key=grouping_key,
                timeout=max(0.001, min(timeout_s, self.timeout_s)),
                handler=self._handler,
            )
        except Exception as error:
            logger.warning(
                "PushgatewayExporter %r: deleting its group %s failed: %s", self.name, grouping_key, error
            )

    def _push(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ExportFailed("push failed: no time left")
        try:
            self._client.push_to_gateway(
                self.url,
                job=self.job,
                registry=self._registry,
                grouping_key=self._grouping_key,
                timeout=timeout_s,
                handler=self._handler,
            )
        except Exception as error:
            raise ExportFailed("push failed") from error
        self._pending = False
        self._pushed_key = self._grouping_key

    def _handler(self, url: str, method: str, timeout: float | None, headers: Any, data: bytes) -> Any:
        exposition = self._client.exposition
        if self._credentials is None:
            return exposition.default_handler(url, method, timeout, headers, data)
        return exposition.basic_auth_handler(url, method, timeout, headers, data, *self._credentials)

    def __repr__(self) -> str:
        return f"PushgatewayExporter(url={self.url!r}, job={self.job!r}, grouping_key={self._extra_key!r})"


def _split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """`url` without its `user:password@`, and the (unquoted) user and password if it had them."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    if "@" not in parts.netloc:
        return url, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    credentials = (unquote(parts.username or ""), unquote(parts.password or ""))
    return (bare if "//" in url else bare.removeprefix("//")), credentials
