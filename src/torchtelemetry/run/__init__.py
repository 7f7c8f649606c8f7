"""What lasts for the whole run, beyond one window: its identity and attempts, the progress file,
the heartbeat and the hang monitor, goodput's lasting state, captures and traces.

`Telemetry` builds these from narrow arguments; the per-window `Signal` hooks stay in
`torchtelemetry.report.signals`.
"""

__all__: list[str] = []
