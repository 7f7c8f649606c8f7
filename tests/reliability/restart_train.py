"""One rank of a small training run that checkpoints `Telemetry` with torch.distributed.checkpoint.

    python -m tests.reliability.restart_train --rendezvous FILE --out run.jsonl --checkpoints DIR \
        [--resume] [--stall-after STEP] [--progress-file FILE] [--run-id ID] [--pushgateway URL]

Rank and world size come from RANK / WORLD_SIZE. Every `--save-every` steps the run saves
`{"telemetry": telemetry, "app": {"step": step}}` with `dcp.save`; `--resume` loads the newest
complete checkpoint and continues from the step after it; each save is marked durable with
`checkpoint_saved` (goodput), and `--progress-file` is `TelemetryConfig.progress_file`; without
`--run-id` the run finds its id itself (a resumed run: the killed one's). `--pushgateway` pushes
there too. With
`--stall-after`, the rank exports what it has (with a progress file, every window in flight too),
writes `<out>.stalled.<rank>` after that step and waits to be killed (the test kills every rank
with SIGKILL there, as a preempted or crashed job would be).
The data of each (rank, step) is fixed, so an interrupted and restarted run can be compared
with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import torchtelemetry as tt
from tests.step_inputs import step_inputs
from torchtelemetry.export import Exporter

BINS = [0.5, 1.0, 2.0]
NUM_CLASSES = 4


def make_metrics() -> dict[str, dict[str, tt.Metric]]:
    return {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "seen": tt.SumMetric(kind="counter"),
            "worst": tt.MaxMetric(),
            "grad_norm": tt.HistogramMetric(BINS),
        },
        "eval": {"accuracy": tt.AccuracyMetric()},
    }


def feed(metrics: dict[str, dict[str, tt.Metric]], rank: int, step: int) -> int:
    """Update every metric with the batch of (rank, step); return its token count."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = 8 + (rank + step) % 5
    train = metrics["train"]
    train["loss"].update(torch.rand(tokens, generator=gen, dtype=torch.float64), torch.ones(tokens))
    train["seen"].update(float(tokens))
    train["worst"].update(torch.randn(3, generator=gen, dtype=torch.float64))
    train["grad_norm"].update(torch.rand(4, generator=gen, dtype=torch.float64) * 3)
    logits = torch.randn(6, NUM_CLASSES, generator=gen, dtype=torch.float64)
    metrics["eval"]["accuracy"].update(logits, torch.randint(0, NUM_CLASSES, (6,), generator=gen))
    return tokens


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint whose metadata was written (dcp writes it last)."""
    complete = [path for path in directory.glob("step_*") if (path / ".metadata").exists()]
    return max(complete, key=lambda path: int(path.name.removeprefix("step_")), default=None)


def wait_for_progress(path: Path, step: int | None, timeout_s: float = 60.0) -> None:
    """Wait until the progress file (written on a thread of its own) holds `step`."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and json.loads(path.read_text() or "{}").get("step") == step):
        assert time.monotonic() < deadline, f"{path} never held step {step}"
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--progress-file", default=None)
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--pushgateway", default=None)
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    metrics = make_metrics()
    exporters: list[Exporter] = [tt.JsonlExporter(args.out)]
    if args.pushgateway:
        exporters.append(tt.PushgatewayExporter(args.pushgateway))
    telemetry = tt.Telemetry(
        metrics, exporters, every=args.every, run_id=args.run_id, progress_file=args.progress_file
    )
    app = {"step": -1}
    checkpoints = Path(args.checkpoints)
    if args.resume:
        checkpoint = latest_checkpoint(checkpoints)
        assert checkpoint is not None, f"no complete checkpoint under {checkpoints}"
        state = {"telemetry": telemetry, "app": app}
        dcp.load(state, checkpoint_id=str(checkpoint))
        app = state["app"]
    for step in range(app["step"] + 1, args.steps):
        tokens = feed(metrics, rank, step)
        telemetry.step(step, **step_inputs(tokens=torch.tensor(tokens), samples=6, learning_rate=0.01 * step))
        if (step + 1) % args.save_every == 0:
            dcp.save(
                {"telemetry": telemetry, "app": {"step": step}},
                checkpoint_id=str(checkpoints / f"step_{step}"),
            )
            telemetry.checkpoint_saved(step)
        if step == args.stall_after:
            if args.progress_file:  # the windows in flight are exported, and the progress file says so
                telemetry.state_dict()
                if telemetry.is_exporting:
                    wait_for_progress(Path(args.progress_file), telemetry.latest_step)
            telemetry.hub.force_flush(10.0)
            Path(f"{args.out}.stalled.{rank}").touch()
            while True:
                time.sleep(1)
    telemetry.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
