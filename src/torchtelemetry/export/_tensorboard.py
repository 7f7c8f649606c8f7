"""`TensorBoardExporter`: each report becomes TensorBoard scalars and histograms at its step."""

from __future__ import annotations

import json
import logging
import math
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

__all__ = ["CONFIG_TAG", "TensorBoardExporter"]

logger = logging.getLogger(__name__)

CONFIG_TAG = "run/config"
"""Tag of the text summary holding the run id, world size and config (TensorBoard's Text tab)."""


class TensorBoardExporter(BaseExporter):
    """Writes every report to TensorBoard event files through `torch.utils.tensorboard.SummaryWriter`.

    `log_dir` is the directory the event files go in, as `SummaryWriter` names it; by default
    `runs/<run id>`, so each training run is one TensorBoard run and a restarted job with the
    same run id appends to it. The run id, world size and config are written once as text
    (tag `run/config`). Each value becomes a scalar (TensorBoard stores float32) at the report's
    step and collection time; a value per label one scalar per label (`train/step_time/rank_0`).
    The exporter prefers deltas for histograms (`preferred_temporality`), so each histogram is the window's
    distribution, written with its exact buckets between the bounds (`add_histogram_raw`, `min` and
    `max` the first and last bound), and the open outer buckets' counts as the scalars
    `<path>/underflow` and `<path>/overflow` (`drawn_histogram`: no edge is made up for them);
    `sum` and `sum_squares` are NaN, since the library does not track them for the drawn part. Counters stay
    running totals. Events are written by the writer's own thread; `force_flush` and `close`
    wait for them to reach the file. A label value sanitized into the tag of another label value
    (`a/b` and `a_b`) is left out, logged, and the report counted as failed (`TrackerKeys`).
    """

    preferred_temporality: ClassVar[Mapping[MetricKind, Temporality]] = {
        MetricKind.HISTOGRAM: Temporality.DELTA
    }

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        flush_secs: float = 120.0,
        max_queue: int = 10,
        name: str = "tensorboard",
    ) -> None:
        import_optional("tensorboard", "tensorboard", "TensorBoardExporter")
        from torch.utils.tensorboard import SummaryWriter

        if flush_secs <= 0:
            raise ValueError(f"TensorBoardExporter: flush_secs must be positive, got {flush_secs}")
        if max_queue < 1:
            raise ValueError(f"TensorBoardExporter: max_queue must be at least 1, got {max_queue}")
        super().__init__(name)
        self._summary_writer = SummaryWriter
        self.log_dir = Path(log_dir) if log_dir is not None else None
        """Directory of the event files (`runs/<run id>` once started when None was given)."""
        self._flush_secs = flush_secs
        self._max_queue = max_queue
        self._keys = TrackerKeys(
            f"TensorBoardExporter {name!r}", histogram_fields=OUTER_BUCKET_FIELDS, histogram_key=True
        )
        self._writer: Any = None

    def destination(self) -> str | None:
        return str(self.log_dir) if self.log_dir is not None else None

    def _describe(self, descriptors: Sequence[MetricDescriptor], run: RunInfo) -> None:
        self._keys.describe(descriptors)

    def _start(self, run: RunInfo) -> None:
        """Open the event file and write the run's config; a failure is logged and every export then fails."""
        if self.log_dir is None:
            self.log_dir = Path("runs") / run.run_id
        try:
            self._writer = self._summary_writer(
                str(self.log_dir), max_queue=self._max_queue, flush_secs=self._flush_secs
            )
            self._writer.add_text(CONFIG_TAG, _config_text(run), global_step=0)
        except Exception as error:
            logger.error(
                "TensorBoardExporter %r: cannot write event files in %s (%s: %s); nothing will be logged",
                self.name,
                self.log_dir,
                type(error).__name__,
                error,
            )
            self._writer = None
            return
        logger.info("TensorBoardExporter %r: event files in %s", self.name, self.log_dir)

    def _export(self, step: int, values: ReportValues, timestamp: float) -> None:
        writer = self._writer
        if writer is None:
            raise ExportFailed(f"no event file (could not write in {self.log_dir}); nothing logged")
        keyed, left_out = self._keys.keyed(values)
        try:
            for tag, value in keyed:
                if isinstance(value, HistogramValue):
                    _add_histogram(writer, tag, value, step, timestamp)
                    drawn = drawn_histogram(value)
                    for field in OUTER_BUCKET_FIELDS:
                        writer.add_scalar(
                            self._keys.field_key(tag, field), getattr(drawn, field), step, walltime=timestamp
                        )
                else:
                    writer.add_scalar(tag, value, step, walltime=timestamp)
        except Exception as error:
            raise ExportFailed(f"writing events in {self.log_dir} failed") from error
        if left_out:
            raise ExportFailed(f"values left out: {'; '.join(left_out)}")

    def _flush(self, timeout_s: float) -> bool:
        """Wait until the writer's thread has written every event to the file."""
        if self._writer is None:
            return False
        self._writer.flush()
        return True

    def _close(self, timeout_s: float) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


def _add_histogram(writer: Any, tag: str, value: HistogramValue, step: int, timestamp: float) -> None:
    """The buckets between the bounds, exactly (none to draw for a single bound)."""
    drawn = drawn_histogram(value)
    if not drawn.counts:
        return
    writer.add_histogram_raw(
        tag,
        min=drawn.edges[0],
        max=drawn.edges[-1],
        num=sum(drawn.counts),
        sum=math.nan,
        sum_squares=math.nan,
        bucket_limits=list(drawn.edges[1:]),
        bucket_counts=list(drawn.counts),
        global_step=step,
        walltime=timestamp,
    )


def _config_text(run: RunInfo) -> str:
    """Markdown for TensorBoard's Text tab: the run id, world size and config as JSON."""
    config = json.dumps(dict(run.config), indent=2, sort_keys=True, default=str)
    return f"run id: `{run.run_id}`, world size: {run.world_size}\n\n```json\n{config}\n```"
