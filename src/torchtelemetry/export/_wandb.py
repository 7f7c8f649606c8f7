"""`WandbExporter`: each report becomes one `run.log(..., step=step)` of a Weights & Biases run."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from torchtelemetry._optional import import_optional
from torchtelemetry.export._base import BaseExporter, ExportFailed
from torchtelemetry.export._histograms import OUTER_BUCKET_FIELDS, drawn_histogram
from torchtelemetry.export._naming import TrackerKeys
from torchtelemetry.export._protocol import RunInfo
from torchtelemetry.export._temporality import Temporality
from torchtelemetry.metric import MetricKind
from torchtelemetry.report import HistogramValue, MetricDescriptor, ReportValues

__all__ = ["WandbExporter"]

logger = logging.getLogger(__name__)

_MODES = ("online", "offline", "disabled", "shared")
_RESUME = ("allow", "must", "never")
_SUMMARIES = ("min", "max", "mean", "last", "first", "none")


class WandbExporter(BaseExporter):
    """Logs every report to a W&B run with an explicit, non-decreasing step.

    The run starts on the first `describe()` (which only rank 0's hub makes):
    its id is `run_id`, else the `RunInfo`'s run id, so a restarted job with the
    same id resumes the same W&B run (`resume="allow"`). Its config is the
    `RunInfo` config updated with `config`. If the process already has an
    active `wandb.run`, that run is used and left open on `close()`.

    `mode` ("online", "offline", "disabled", "shared") wins over `WANDB_MODE`,
    which wins over W&B's default. W&B silently drops a step lower than one
    already logged; this exporter drops it first, with a warning, and reports
    FAILURE (a report at the last logged step joins that step's row).
    `summaries` maps a metric path or glob (`"train/*"`) to a W&B summary
    ("min", "max", "mean", "last", "first", "none", or a comma-separated mix),
    e.g. `{"train/loss": "min"}`. The exporter prefers deltas for histograms
    (`preferred_temporality`), so each becomes a `wandb.Histogram` of the exact
    counts since the previous report of the buckets between its bounds, and W&B's
    histogram panels show each window's distribution; the open outer buckets' counts
    are `<path>/underflow` and `<path>/overflow` (`drawn_histogram`: no edge is made
    up for them); counters stay running totals. Per-label values become one key per label
    (`train/step_time/rank_0`); a label value
    sanitized into the key of another label value (`a/b` and `a_b`) is left out, logged, and the
    report counted as failed (`TrackerKeys`).
    Credentials stay with W&B: nothing from the settings or environment is logged.
    """

    preferred_temporality: ClassVar[Mapping[MetricKind, Temporality]] = {
        MetricKind.HISTOGRAM: Temporality.DELTA
    }

    def __init__(
        self,
        project: str | None = None,
        *,
        entity: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Sequence[str] | None = None,
        group: str | None = None,
        mode: str | None = None,
        dir: str | Path | None = None,
        run_id: str | None = None,
        resume: str = "allow",
        summaries: Mapping[str, str] | None = None,
        name: str = "wandb",
    ) -> None:
        self._wandb = import_optional("wandb", "wandb", "WandbExporter")
        if mode is not None and mode not in _MODES:
            raise ValueError(f"WandbExporter: mode must be one of {_MODES} or None, got {mode!r}")
        if resume not in _RESUME:
            raise ValueError(f"WandbExporter: resume must be one of {_RESUME}, got {resume!r}")
        for pattern, summary in (summaries or {}).items():
            if not summary or any(part.strip() not in _SUMMARIES for part in summary.split(",")):
                raise ValueError(
                    f"WandbExporter: summaries[{pattern!r}] must be one of {_SUMMARIES} "
                    f"(or a comma-separated mix), got {summary!r}"
                )
        super().__init__(name)
        self._init_args: dict[str, Any] = {
            "project": project,
            "entity": entity,
            "name": run_name,
            "tags": list(tags) if tags is not None else None,
            "group": group,
            "mode": mode,
            "dir": str(dir) if dir is not None else None,
            "id": run_id,
            "resume": resume,
        }
        self._config = dict(config or {})
        self._summaries = dict(summaries or {})
        self._keys = TrackerKeys(
            f"WandbExporter {name!r}", histogram_fields=OUTER_BUCKET_FIELDS, histogram_key=True
        )
        self._run: Any = None
        self._owns_run = False
        self._last_step: int | None = None
        self.dropped_steps = 0
        """Reports dropped because their step was below the last logged step (also counted in `errors`)."""

    @property
    def run(self) -> Any:
        """The `wandb.Run` in use (None before the first `describe()` or after a failed start)."""
        return self._run

    @property
    def url(self) -> str | None:
        """The run's page (online mode); None offline or before the run starts."""
        return getattr(self._run, "url", None) if self._run is not None else None

    @property
    def path(self) -> str | None:
        """The directory the run writes to; None before the run starts."""
        return getattr(self._run, "dir", None) if self._run is not None else None

    def destination(self) -> str | None:
        return self.url or self.path

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._keys.describe(descriptors)

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        """`run.log(row, step=step)`; a step below the last logged one is dropped."""
        if self._run is None:
            raise ExportFailed("no W&B run (wandb.init failed at describe()); nothing logged")
        if self._last_step is not None and step < self._last_step:
            self.dropped_steps += 1
            logger.warning(  # every time, not once per burst: these values are lost
                "WandbExporter %r: step %d dropped: W&B only keeps steps from the last logged step %d on",
                self.name,
                step,
                self._last_step,
            )
            raise ExportFailed(f"below the last logged step {self._last_step}")
        keyed, left_out = self._keys.keyed(values)
        try:
            self._run.log(self._row(keyed), step=step)
        except Exception as error:
            raise ExportFailed("run.log failed") from error
        self._last_step = step
        if left_out:
            raise ExportFailed(f"values left out: {'; '.join(left_out)}")

    def _flush(self, timeout_s: float) -> bool:
        """Nothing is buffered here (W&B's own process persists each `log`); True while the run is open."""
        return self._run is not None

    def _close(self, timeout_s: float) -> None:
        """`run.finish()` (which waits for W&B to persist/upload) unless the run is the user's."""
        run, self._run = self._run, None
        if run is not None and self._owns_run:
            run.finish()

    def _start(self, info: RunInfo) -> None:
        """Start the W&B run (or adopt the active one); a failure is logged and every export then fails."""
        wandb = self._wandb
        if wandb.run is not None:
            self._run = wandb.run
            logger.info("WandbExporter %r: logging to the active W&B run %s", self.name, self._run.id)
        else:
            args = {key: value for key, value in self._init_args.items() if value is not None}
            args.setdefault("id", info.run_id)
            config = {**info.config, **self._config}
            config.setdefault("world_size", info.world_size)
            try:
                if "dir" in args:
                    Path(args["dir"]).mkdir(parents=True, exist_ok=True)
                self._run = wandb.init(config=config, **args)
            except Exception as error:
                logger.error(
                    "WandbExporter %r: wandb.init failed (%s: %s); nothing will be logged",
                    self.name,
                    type(error).__name__,
                    error,
                )
                return
            self._owns_run = True
            logger.info(
                "WandbExporter %r: W&B run %s (project %s, mode %s)",
                self.name,
                self._run.id,
                self._run.project,
                self._run.settings.mode,
            )
        if getattr(self._run, "resumed", False) and self._run.step > 0:
            self._last_step = self._run.step - 1
        try:
            for pattern, summary in self._summaries.items():
                self._run.define_metric(pattern, summary=summary)
        except Exception:
            logger.exception("WandbExporter %r: define_metric failed", self.name)

    def _row(self, keyed: Sequence[tuple[str, float | HistogramValue]]) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for key, value in keyed:
            if isinstance(value, HistogramValue):
                drawn = drawn_histogram(value)
                if drawn.counts:
                    counts = [int(count) if float(count).is_integer() else count for count in drawn.counts]
                    row[key] = self._wandb.Histogram(np_histogram=(counts, list(drawn.edges)))
                for field in OUTER_BUCKET_FIELDS:
                    row[self._keys.field_key(key, field)] = getattr(drawn, field)
            else:
                row[key] = value
        return row
