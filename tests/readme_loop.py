"""README.md's training loop, as the tests that count what a step and a window of it cost run it: the
loss (weighted by the number of targets), accuracy from logits, a grad-norm histogram, three phases,
the data wait and `step(tokens=, learning_rate=)` (bench/bench_launches.py times the same loop)."""

from __future__ import annotations

import torch

import torchtelemetry as tt

PHASES = ("forward", "backward", "optimizer")


class ReadmeLoop:
    """The metrics of README.md's loop and one step of it (fixed inputs: what it costs does not depend
    on their values)."""

    def __init__(self) -> None:
        self.metrics = {
            "train": {
                "loss": tt.WeightedMeanMetric(),
                "accuracy": tt.AccuracyMetric(),
                "grad_norm": tt.HistogramMetric(bins=[0.1, 0.5, 1, 2, 5, 10]),
            }
        }
        self.loss, self.logits = torch.tensor(2.0), torch.randn(8, 4)
        self.targets = torch.tensor([0, 1, 2, 3] * 2)

    def step(self, telemetry: tt.Telemetry, index: int) -> None:
        train = self.metrics["train"]
        with telemetry.data_wait():
            pass
        for phase in PHASES:
            with telemetry.phase(phase):
                pass
        train["loss"].update(self.loss, self.targets.numel())
        train["accuracy"].update(self.logits, self.targets)
        train["grad_norm"].update(torch.tensor(1.5))
        telemetry.step(index, tokens=self.targets.numel(), learning_rate=0.1)
