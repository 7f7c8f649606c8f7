"""LightningTelemetryCallback and LightningTelemetryLogger on a real 2-process CPU DDP run."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

L = pytest.importorskip("lightning.pytorch")

from torchtelemetry import JsonlExporter, MaxMetric, SumMetric  # noqa: E402
from torchtelemetry.integrations import LightningTelemetryCallback, LightningTelemetryLogger  # noqa: E402

STEPS = 6
EVERY = 2


class TinyRegression(L.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)
        self.losses: list[float] = []
        self.max_errors: list[float] = []

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> dict[str, torch.Tensor]:
        x, y = batch
        error = self.layer(x).squeeze(-1) - y
        loss = (error**2).mean()
        self.losses.append(loss.item())
        self.max_errors.append(error.abs().max().item())
        self.log("lightning_loss", loss)
        return {"loss": loss, "abs_error": error.detach().abs()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2 * STEPS * 3, self.hparams.width, generator=generator)
        y = x.sum(-1) + 0.1 * torch.randn(x.shape[0], generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)


def _update(metrics, outputs, batch) -> None:
    metrics["train/examples"].update(torch.tensor(float(batch[0].shape[0])))
    metrics["train/max_abs_error"].update(outputs["abs_error"].max())


def _fit(rank: int, world_size: int, path: str, tmp: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    calls: list[str] = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    metrics = {"train/examples": SumMetric(kind="counter"), "train/max_abs_error": MaxMetric()}
    callback = LightningTelemetryCallback(
        metrics, [JsonlExporter(path)], every=EVERY, update=_update, run_id="lightning-test"
    )
    model = TinyRegression()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        callbacks=[callback],
        logger=LightningTelemetryLogger(callback),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(model)
    dist.all_reduce = all_reduce
    collector_calls = sum(name.startswith("torchtelemetry-collector") for name in calls)
    return {"losses": model.losses, "max_errors": model.max_errors, "collector_all_reduces": collector_calls}


def _reports(path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def test_ddp_run_exports_exact_global_values_with_one_collective_per_window(tmp_path) -> None:
    path = tmp_path / "telemetry.jsonl"
    ranks = run_ranks(_fit, 2, str(path), str(tmp_path), timeout_s=240)

    reports = _reports(path)
    assert [report["step"] for report in reports] == [2, 4, 6]
    assert {report["run_id"] for report in reports} == {"lightning-test"}
    for index, report in enumerate(reports):
        window = slice(index * EVERY, (index + 1) * EVERY)
        losses = [loss for rank in ranks for loss in rank["losses"][window]]
        values = report["values"]
        assert values["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
        assert values["train/max_abs_error"] == pytest.approx(
            max(error for rank in ranks for error in rank["max_errors"][window]), rel=1e-6
        )
        assert values["train/examples"] == 2 * 3 * EVERY * (index + 1)
        assert values["train/learning_rate"] == pytest.approx(0.05)
        # What the module logged with self.log on rank 0, at the last batch of the window.
        assert values["lightning_loss"] == pytest.approx(ranks[0]["losses"][window][-1], rel=1e-6)

    # Eight metrics (loss, examples, max error, five built-in signals) in two buckets (SUM and MAX,
    # float64), gathered in one all-reduce per collection, plus one layout check on the collector's
    # new group.
    windows = STEPS // EVERY
    assert [rank["collector_all_reduces"] for rank in ranks] == [1 + windows] * 2


def _single_process_fit(callback, max_steps: int, tmp, ckpt_path=None) -> None:
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[callback, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(TinyRegression(), ckpt_path=ckpt_path)


def test_counter_totals_survive_a_checkpoint_and_resume(tmp_path) -> None:
    def callback(path):
        metrics = {"train/examples": SumMetric(kind="counter"), "train/max_abs_error": MaxMetric()}
        return LightningTelemetryCallback(metrics, [JsonlExporter(path)], every=EVERY, update=_update)

    _single_process_fit(callback(tmp_path / "first.jsonl"), 3, tmp_path)
    # The checkpoint at step 3 exported the partial window first, so nothing is counted twice.
    assert [(r["step"], r["values"]["train/examples"]) for r in _reports(tmp_path / "first.jsonl")] == [
        (2, 6.0),
        (3, 9.0),
    ]

    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    _single_process_fit(callback(tmp_path / "resumed.jsonl"), 6, tmp_path, ckpt_path=checkpoint)
    # The collections stay on the every-2 grid across the restart (the checkpoint's own one at 3 aside).
    assert [(r["step"], r["values"]["train/examples"]) for r in _reports(tmp_path / "resumed.jsonl")] == [
        (4, 12.0),
        (6, 18.0),
    ]


class SevenBatchRegression(TinyRegression):
    """Seven batches per epoch: the epoch ends off the every-3 grid."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randn(21, self.hparams.width, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(-1)), batch_size=3)


def test_collections_stay_on_the_grid_across_epoch_ends_and_self_log_rides_in_them(tmp_path) -> None:
    path = tmp_path / "telemetry.jsonl"
    callback = LightningTelemetryCallback(
        {"train/examples": SumMetric(kind="counter")},
        [JsonlExporter(path)],
        update=lambda metrics, outputs, batch: metrics["train/examples"].update(torch.tensor(3.0)),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        log_every_n_steps=3,  # the callback's every
        callbacks=[callback],
        logger=LightningTelemetryLogger(callback),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,  # checkpointing on: a checkpoint at each epoch end (steps 7 and 14)
    )
    trainer.fit(SevenBatchRegression())

    reports = _reports(path)
    collected = [r["step"] for r in reports if "train/examples" in r["values"]]
    assert collected == [3, 6, 7, 9, 12, 14], "the grid (3, 6, 9, 12) outlives the epoch-end checkpoints"
    assert [r["values"]["train/examples"] for r in reports if "train/examples" in r["values"]] == [
        3.0 * step for step in collected
    ]
    logged = [r for r in reports if "lightning_loss" in r["values"]]
    assert [r["step"] for r in logged] == [3, 6, 9, 12]
    assert all("train/loss" in r["values"] for r in logged), "self.log values ride in that step's report"


def test_a_torchrun_launch_the_trainer_does_not_match_is_an_error(tmp_path, monkeypatch) -> None:
    # torchrun --nproc_per_node=2 with Trainer(devices=1): two independent 1-rank runs otherwise.
    monkeypatch.setenv("WORLD_SIZE", "2")
    callback = LightningTelemetryCallback({"train/examples": SumMetric(kind="counter")}, [])
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 processes but the Trainer runs 1"):
        _single_process_fit(callback, 2, tmp_path)
