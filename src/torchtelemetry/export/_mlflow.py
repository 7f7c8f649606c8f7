"""`MLflowExporter`: each report becomes one `log_batch` of an MLflow run, at its step and timestamp."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

from torchtelemetry._optional import import_optional
from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._naming import TrackerKeys
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.export._temporality import Temporality
from torchtelemetry.export._urls import redact_url
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import HistogramValue, MetricDescriptor, ReportValues

__all__ = ["EXPERIMENT_NAME_ENV", "RUN_ID_TAG", "TRACKING_URI_ENV", "MLflowExporter"]

logger = logging.getLogger(__name__)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
"""MLflow's own variable for the tracking server or store, read when no `tracking_uri` is given."""
EXPERIMENT_NAME_ENV = "MLFLOW_EXPERIMENT_NAME"
"""MLflow's own variable for the experiment, read when no `experiment_name` is given."""
RUN_ID_TAG = "torchtelemetry.run_id"
"""Tag holding the training run's id: a restarted job with the same id resumes the same MLflow run."""

_MAX_METRICS_PER_BATCH = 1000  # MLflow's limits for one log_batch
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_LENGTH = 6000
_HISTOGRAM_FIELDS = ("count", "sum", "mean")


class MLflowExporter(BaseExporter):
    """Logs every report to one MLflow run per training run, one `log_batch` per report.

    The tracking URI is `tracking_uri`, else `$MLFLOW_TRACKING_URI` (or `mlflow.set_tracking_uri`),
    else MLflow's default (`sqlite:///mlflow.db` in the working directory since MLflow 3). The
    experiment is `experiment_name`, else `$MLFLOW_EXPERIMENT_NAME`, else MLflow's "Default";
    it is created if missing. The run is tagged with the `RunInfo`'s run id (`torchtelemetry.run_id`)
    and world size, so a restarted job with the same run id resumes the same MLflow run; its
    name is `run_name`, else the run id; the `RunInfo` config updated with `config` becomes the
    run's params (values longer than MLflow's 6000 characters are cut, with a warning).

    A tracking server is never contacted on the training thread: the client, the experiment and the
    run are made by the first export, on the exporter's thread, and retried by each export until
    they exist, so an unreachable server costs failed (counted) exports, never training time. How
    long one try may take is MLflow's own setting (`MLFLOW_HTTP_REQUEST_TIMEOUT`,
    `MLFLOW_HTTP_REQUEST_MAX_RETRIES`). A local store (`sqlite:`, `file:` or a path) is made when
    the exporter starts instead, as `Telemetry` is built: creating a SQLite store runs MLflow's
    migrations (seconds), and reports that piled up meanwhile were dropped from a full queue. Each
    value becomes one metric at the report's step and timestamp; a value per label one metric per
    label (`train/step_time/rank_0`). MLflow has no histograms: the exporter prefers deltas for them
    (`preferred_temporality`), and each histogram becomes the window's `<path>/count`, `<path>/sum`
    and `<path>/mean` (no mean in a window without values). Counters stay running totals. The run
    ends (`FINISHED`) on close. Keys are checked (`TrackerKeys`): a histogram's `<path>/count`
    against a metric `<path>/count` raises `NameCollisionError` in `describe`; a label value
    sanitized into a key another label value already has is left out of every report, logged, and
    the report counted as failed.
    """

    preferred_temporality: ClassVar[Mapping[MetricKind, Temporality]] = {
        MetricKind.HISTOGRAM: Temporality.DELTA
    }

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment_name: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
        name: str = "mlflow",
    ) -> None:
        mlflow = import_optional("mlflow", "mlflow", "MLflowExporter")
        super().__init__(name)
        self._mlflow = mlflow
        self.tracking_uri: str = tracking_uri or mlflow.get_tracking_uri()
        """Where the run is logged: the argument, else `$MLFLOW_TRACKING_URI`, else MLflow's default."""
        self.experiment_name = experiment_name or os.environ.get(EXPERIMENT_NAME_ENV) or None
        """The experiment of the run (None: MLflow's "Default" experiment)."""
        self._run_name = run_name
        self._config = dict(config or {})
        self._tags = {str(key): str(value) for key, value in (tags or {}).items()}
        self._keys = TrackerKeys(f"MLflowExporter {name!r}", histogram_fields=_HISTOGRAM_FIELDS)
        self._info: RunInfo | None = None
        self._client: Any = None
        self.run_id: str | None = None
        """The MLflow run id (None until the first export reached the tracking store)."""

    def destination(self) -> str | None:
        return redact_url(self.tracking_uri)

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._keys.describe(descriptors)

    def _start(self, run: RunInfo) -> None:
        """Remember the run; make a local store's run now (a tracking server's: at the first export)."""
        self._info = run
        if not _is_local(self.tracking_uri):
            return
        try:
            self._ensure_run()
        except ExportFailed as error:
            logger.error(
                "MLflowExporter %r: %s (%s); each export tries again",
                self.name,
                error,
                error.__cause__,
            )

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """`log_batch` of every value at `step` and `timestamp` (in chunks of MLflow's 1000 metrics)."""
        run_id = self._ensure_run()
        metric = self._mlflow.entities.Metric
        milliseconds = int(timestamp * 1000)
        keyed, left_out = self._keys.keyed(values)
        metrics = [metric(key, value, milliseconds, step) for key, value in self._values(keyed)]
        try:
            for start in range(0, len(metrics), _MAX_METRICS_PER_BATCH):
                self._client.log_batch(run_id, metrics=metrics[start : start + _MAX_METRICS_PER_BATCH])
        except Exception as error:
            raise ExportFailed(f"log_batch to {redact_url(self.tracking_uri)} failed") from error
        if left_out:
            raise ExportFailed(f"values left out: {'; '.join(left_out)}")

    def _flush(self, timeout_s: float) -> bool:
        """Nothing is buffered here (each `log_batch` returns once stored); True once the run exists."""
        return self.run_id is not None

    def _close(self, timeout_s: float) -> None:
        """End the run as FINISHED (a run never reached is left alone)."""
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, status="FINISHED")

    def _ensure_run(self) -> str:
        """The MLflow run id, creating the client, experiment and run (or resuming the run) first."""
        if self.run_id is not None:
            return self.run_id
        assert self._info is not None  # the base class calls _start before any _export
        try:
            if self._client is None:
                self._client = self._mlflow.MlflowClient(tracking_uri=self.tracking_uri)
            experiment_id = self._experiment_id()
            found = self._client.search_runs(
                [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = {_quoted(self._info.run_id)}"
            )
            run = found[0] if found else None
            if run is None:
                run = self._client.create_run(
                    experiment_id, run_name=self._run_name or self._info.run_id, tags=self._run_tags()
                )
            else:
                self._client.update_run(run.info.run_id, status="RUNNING")
            self._log_params(run.info.run_id, already=run.data.params)
        except Exception as error:
            raise ExportFailed(f"cannot start an MLflow run at {redact_url(self.tracking_uri)}") from error
        self.run_id = run.info.run_id
        logger.info(
            "MLflowExporter %r: %s MLflow run %s at %s",
            self.name,
            "resumed" if found else "started",
            self.run_id,
            redact_url(self.tracking_uri),
        )
        return self.run_id

    def _experiment_id(self) -> str:
        if self.experiment_name is None:
            return self._mlflow.tracking.default_experiment.DEFAULT_EXPERIMENT_ID
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self._client.create_experiment(self.experiment_name)
        except self._mlflow.exceptions.MlflowException:  # created meanwhile by another job
            experiment = self._client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _run_tags(self) -> dict[str, str]:
        assert self._info is not None
        return {
            **self._tags,
            RUN_ID_TAG: self._info.run_id,
            "torchtelemetry.world_size": str(self._info.world_size),
        }

    def _log_params(self, run_id: str, already: Mapping[str, str]) -> None:
        """The config as params; on a resumed run only the new keys (MLflow params never change)."""
        assert self._info is not None
        param = self._mlflow.entities.Param
        params = []
        for key, value in {**self._info.config, **self._config}.items():
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > _MAX_PARAM_LENGTH:
                logger.warning(
                    "MLflowExporter %r: param %r is %d characters; MLflow keeps %d, the rest is cut",
                    self.name,
                    key,
                    len(text),
                    _MAX_PARAM_LENGTH,
                )
                text = text[:_MAX_PARAM_LENGTH]
            if key not in already:
                params.append(param(str(key), text))
        for start in range(0, len(params), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=params[start : start + _MAX_PARAMS_PER_BATCH])

    def _values(self, keyed: Sequence[tuple[str, float | HistogramValue]]) -> Iterator[tuple[str, float]]:
        """Floats as they are; a histogram as its count, sum and (with values) mean."""
        field_key = self._keys.field_key
        for key, value in keyed:
            if isinstance(value, HistogramValue):
                yield field_key(key, "count"), float(value.count)
                yield field_key(key, "sum"), float(value.sum)
                if value.count:
                    yield field_key(key, "mean"), value.sum / value.count
            else:
                yield key, value


def _is_local(tracking_uri: str) -> bool:
    """A store on this machine's disk (`sqlite:`, `file:`, a bare path), not a tracking server."""
    scheme = tracking_uri.partition(":")[0].lower() if ":" in tracking_uri else ""
    return scheme in ("", "sqlite", "file") or len(scheme) == 1  # a Windows drive letter


def _quoted(text: str) -> str:
    """A string literal for MLflow's search filter."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
