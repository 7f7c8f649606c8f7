"""`DemoConfig`: what the demo trains and where it exports; the command line is generated from it.

Every exporter field means the same with the same value: a destination (URL, path, mode) turns
its exporter on there, `""` turns it on at its default destination (`DEFAULT_DESTINATION`), and
None (`none` on the command line) leaves it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_DESTINATION", "DEFAULT_PUSHGATEWAY", "DemoConfig", "run_directory"]

DEFAULT_DESTINATION = ""
"""The value of an exporter field that turns its exporter on at its default destination."""

DEFAULT_PUSHGATEWAY = "http://127.0.0.1:9091"
"""Where `--pushgateway ""` pushes: the Pushgateway of the repository's stack, on loopback."""


def run_directory(run_id: str) -> Path:
    """The run's own directory, `runs/<run_id>` under the working directory (.gitignore ignores
    `/runs/`): the default home of its files, its checkpoint and its captures."""
    return Path("runs") / run_id


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """What the demo trains and where it exports."""

    nproc: int = 2
    """Ranks to spawn (ignored under torchrun)."""
    steps: int = 200
    """Training steps."""
    every: int = 10
    """Steps per window: a collection every this many steps."""
    batch_size: int = 16
    """Sequences per rank per step."""
    seq_len: int = 32
    """Tokens per sequence."""
    vocab: int = 64
    """Vocabulary size of the synthetic language."""
    lr: float = 3e-3
    """Peak learning rate (cosine decay after a short warm-up)."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (CUDA when present)."""
    prometheus_port: int | None = field(default=9464, metadata={"env": "TORCHTELEMETRY_PROMETHEUS_PORT"})
    """Scrape endpoint port on 127.0.0.1 (0 picks a free port; None disables it)."""
    pushgateway: str | None = field(default=None, metadata={"env": "TORCHTELEMETRY_PUSHGATEWAY_URL"})
    """Pushgateway URL, e.g. http://127.0.0.1:9091 ("": http://127.0.0.1:9091, the stack's; none:
    off)."""
    otlp: str | None = None
    """OTLP base endpoint, e.g. http://127.0.0.1:4318 (HTTP) ("": the OTEL_* variables, the default
    when $OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is set; none: off); the protocol comes from
    $OTEL_EXPORTER_OTLP_PROTOCOL."""
    wandb: str | None = field(default=None, metadata={"env": "TORCHTELEMETRY_WANDB"})
    """W&B mode: "offline", "online" or "disabled" ("": $WANDB_MODE, else W&B's default; none:
    off)."""
    tensorboard: str | None = field(default=None, metadata={"env": "TORCHTELEMETRY_TENSORBOARD"})
    """TensorBoard log directory ("": runs/<run_id>/tensorboard; none: off)."""
    mlflow: str | None = field(default=None, metadata={"env": "TORCHTELEMETRY_MLFLOW"})
    """MLflow tracking URI, e.g. sqlite:///mlflow.db ("": $MLFLOW_TRACKING_URI, else MLflow's
    default; none: off)."""
    jsonl: str | None = field(default=DEFAULT_DESTINATION, metadata={"env": "TORCHTELEMETRY_JSONL"})
    """JSONL output path ("", the default: runs/<run_id>/metrics.jsonl; none: off)."""
    console: bool = True
    """A short line per window on stderr (step, loss, throughput, health: `TelemetryConfig.window_lines`)."""
    checkpoint_every: int | None = 50
    """Steps between checkpoints (model, optimizer and telemetry state, one file replaced each time:
    runs/<run_id>/checkpoint/checkpoint.pt; goodput counts the training they hold); None: none."""
    run_id: str | None = None
    """Run id (default: generated)."""
    seed: int = 0
    """Random seed."""
    step_delay_s: float = 0.0
    """Extra host sleep per step in seconds, to slow the run down for live viewing."""

    def __post_init__(self) -> None:
        for key in ("nproc", "steps", "every", "batch_size", "seq_len", "vocab", "checkpoint_every"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"demo.{key} must be at least 1, got {getattr(self, key)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"demo.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.wandb not in (None, DEFAULT_DESTINATION, "offline", "online", "disabled"):
            raise ValueError(f'demo.wandb must be offline, online, disabled or "", got {self.wandb!r}')
