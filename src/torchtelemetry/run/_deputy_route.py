"""How the next rank reports a hang of the exporting rank: a route that does not need that rank.

The exporting rank's exporters stop with it, so the deputy pushes through Pushgateways of its own:
for each `PushgatewayExporter` the run was given, a copy that pushes to the same gateway under the
same grouping key plus `reporter="rank<r>"` (so that it never replaces the exporting rank's group),
started at the deputy's first report and deleted from the gateway at close. Its stack file in
`dump_dir` and its log line are the route of every run, with a Pushgateway or without.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torchtelemetry.export import Exporter, ExportHub, PushgatewayExporter, RunInfo
from torchtelemetry.report import HANG_DESCRIPTORS, ReportValues

__all__ = ["DeputyRoute"]

logger = logging.getLogger(__name__)


class DeputyRoute:
    """Rank `rank`'s own pushes of hang reports to the Pushgateways among `exporters`, as `run`."""

    def __init__(self, exporters: Sequence[Exporter], run: RunInfo, rank: int) -> None:
        self._gateways = [exporter for exporter in exporters if isinstance(exporter, PushgatewayExporter)]
        self.run = run
        """The run reported (its id, agreed by the ranks)."""
        self._reporter = f"rank{rank}"
        self._hub: ExportHub | None = None

    def submit(self, step: int, values: ReportValues) -> None:
        """Push a hang report of `step` (the hub starts at the first)."""
        if not self._gateways:
            return
        if self._hub is None:
            copies = [gateway.reporting_as(self._reporter) for gateway in self._gateways]
            self._hub = ExportHub(copies, run=self.run)
            self._hub.describe(HANG_DESCRIPTORS)
        self._hub.submit(step, values)

    def close(self, timeout_s: float) -> None:
        """Delete the deputy's groups from the gateways (its reports were of a hang only)."""
        if self._hub is not None:
            self._hub.close(timeout_s)
