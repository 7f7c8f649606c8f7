"""The demo's model and data: a tiny causal transformer learning synthetic counting sequences."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtelemetry.demo._config import DemoConfig

__all__ = [
    "StepResult",
    "TinyLM",
    "build_metrics",
    "flops_per_token",
    "learning_rate_at",
    "synthetic_batch",
    "train_step",
    "update_metrics",
]


class TinyLM(nn.Module):
    """A two-layer causal transformer over a small vocabulary."""

    def __init__(self, vocab: int, seq_len: int, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        size = tokens.shape[1]
        return self.head(self.encoder(hidden, mask=self.mask[:size, :size], is_causal=True))


def flops_per_token(model: TinyLM, seq_len: int) -> float:
    """Training FLOPs per token, torchtitan's estimate (`get_num_flop_per_token`): 6 x the parameters
    outside the embeddings, plus 12 x layers x width x sequence length for the attention scores."""
    params = sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith(("embed.", "position"))
    )
    return float(6 * params + 12 * len(model.encoder.layers) * model.embed.embedding_dim * seq_len)


def synthetic_batch(generator: torch.Generator, config: DemoConfig, device: torch.device) -> torch.Tensor:
    """Sequences that count up by a per-sequence stride: learnable, so the loss falls quickly."""
    start = torch.randint(0, config.vocab, (config.batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (config.batch_size, 1), generator=generator)
    positions = torch.arange(config.seq_len + 1).unsqueeze(0)
    return ((start + stride * positions) % config.vocab).to(device, non_blocking=True)  # staged, no sync


def build_metrics(device: torch.device | str = "cpu") -> dict[str, dict[str, Any]]:
    """The demo's metric tree: `train/loss`, `train/accuracy`, `train/grad_norm` (the dashboards' names)."""
    import torchtelemetry as tt

    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(description="Cross-entropy per token"),
            "accuracy": tt.AccuracyMetric(description="Next-token accuracy"),
            "grad_norm": tt.HistogramMetric(
                bins=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10], description="Global gradient norm before clipping"
            ),
        }
    }
    for metric in metrics["train"].values():
        metric.to(device)
    return metrics


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step hands to the metrics (device tensors, detached)."""

    loss: torch.Tensor
    logits: torch.Tensor
    targets: torch.Tensor
    grad_norm: torch.Tensor
    tokens: int


def _untimed(name: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    learning_rate: float,
    phase: Callable[[str], contextlib.AbstractContextManager[Any]] = _untimed,
) -> StepResult:
    """One optimizer step of next-token prediction on `batch` (sequences of `seq_len + 1` tokens),
    its forward, backward and optimizer step each inside `phase(name)` (`Telemetry.phase` times them)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with phase("forward"):
        logits = model(inputs)
        vocab = logits.shape[-1]
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    with phase("backward"):  # holds DDP's gradient all-reduce (`watch_gradient_sync`)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    with phase("optimizer"):
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    return StepResult(
        loss.detach(),
        logits.detach().reshape(-1, vocab),
        targets.reshape(-1),
        grad_norm.detach(),
        targets.numel(),
    )


def update_metrics(metrics: dict[str, dict[str, Any]], result: StepResult) -> None:
    """Fold one step into the demo's metrics: device-side only, no host sync."""
    metrics["train"]["loss"].update(result.loss, result.tokens)
    metrics["train"]["accuracy"].update(result.logits, result.targets)
    metrics["train"]["grad_norm"].update(result.grad_norm)


def learning_rate_at(config: DemoConfig, step: int) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to zero."""
    warmup = max(1, config.steps // 20)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))
