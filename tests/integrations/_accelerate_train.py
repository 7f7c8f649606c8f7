"""A 2-process accelerate loop with TelemetryTracker; launched by torchrun from the test."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from torchtelemetry import JsonlExporter, SumMetric, WeightedMeanMetric
from torchtelemetry.integrations import TelemetryTracker

STEPS = 6
EVERY = 2


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    metrics = {"train/loss": WeightedMeanMetric(), "train/examples": SumMetric(kind="counter")}
    tracker = TelemetryTracker(metrics, [JsonlExporter(out / f"telemetry-rank{rank}.jsonl")], every=EVERY)
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("accelerate-test", config={"lr": 0.05, "batch_size": 2})
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(2 * 2 * STEPS, 3, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(-1)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, (inputs, targets) in enumerate(loader, start=1):
        loss = ((model(inputs).squeeze(-1) - targets) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        tracker.metrics["train/loss"].update(loss.detach())
        tracker.metrics["train/examples"].update(torch.tensor(float(inputs.shape[0])))
        tracker.telemetry.step(step)
        losses.append(loss.item())
        accelerator.log({"main_loss": losses[-1], "note": "strings are skipped"}, step=step)
    tracker.telemetry.close()
    accelerator.end_training()
    (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
