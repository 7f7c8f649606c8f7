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

from tests.servers import http_get  # noqa: E402
from torchtelemetry import JsonlExporter, MaxMetric, PrometheusExporter, SumMetric  # noqa: E402
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
        assert set(values["train/sync_wait"]) == {"0", "1"}  # the wait in DDP's all-reduce, per rank
        # What the module logged with self.log on rank 0, at the last batch of the window.
        assert values["lightning/lightning_loss"] == pytest.approx(ranks[0]["losses"][window][-1], rel=1e-6)

    # Eight metrics (loss, examples, max error, five built-in signals) in two buckets (SUM and MAX,
    # float64), gathered in one all-reduce per collection on the worker (the layout check on the
    # collector's new group ran at bind(), on the training thread).
    windows = STEPS // EVERY
    assert [rank["collector_all_reduces"] for rank in ranks] == [windows] * 2


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
    logged = [r for r in reports if "lightning/lightning_loss" in r["values"]]
    assert [r["step"] for r in logged] == [3, 6, 9, 12]
    assert all("train/loss" in r["values"] for r in logged), "self.log values ride in that step's report"


def test_a_torchrun_launch_the_trainer_does_not_match_is_an_error(tmp_path, monkeypatch) -> None:
    # torchrun --nproc_per_node=2 with Trainer(devices=1): two independent 1-rank runs otherwise.
    monkeypatch.setenv("WORLD_SIZE", "2")
    callback = LightningTelemetryCallback({"train/examples": SumMetric(kind="counter")}, [])
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 processes but the Trainer runs 1"):
        _single_process_fit(callback, 2, tmp_path)


class CommonNames(TinyRegression):
    """Logs under a name a LightningModule often uses, which is also the callback's own loss: as
    `train_loss` it is torchtelemetry_train_loss in Prometheus, as `train/loss` the same path."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log(self.name, 2 * out["loss"])
        return out


class RecordingLogger(L.loggers.Logger):
    """What Lightning hands its loggers, for comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class Scrape(L.Callback):
    """Reads the scrape endpoint at the end of training, before the telemetry closes."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self.exporter = exporter
        self.body = ""

    def on_train_end(self, trainer, pl_module) -> None:
        self.body = http_get(self.exporter.url).decode()


@pytest.mark.parametrize("name", ["train_loss", "train/loss"])
def test_self_log_names_pass_through_unchanged_under_the_lightning_prefix(tmp_path, name: str) -> None:
    """`self.log("train_loss")` / `self.log("train/loss")` and Lightning's `epoch` keep their values
    under lightning/, next to the callback's own train/loss, on every exporter: none is replaced or
    dropped."""
    path = tmp_path / "telemetry.jsonl"
    prometheus = PrometheusExporter(port=0)
    callback = LightningTelemetryCallback(
        {"train/examples": SumMetric(kind="counter")}, [JsonlExporter(path), prometheus], every=EVERY
    )
    recording, scrape = RecordingLogger(), Scrape(prometheus)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        log_every_n_steps=EVERY,
        callbacks=[callback, scrape],
        logger=[LightningTelemetryLogger(callback), recording],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    model = CommonNames(name)
    trainer.fit(model)

    names = (name, "epoch")
    assert recording.logged and all(set(names) <= set(logged) for logged in recording.logged)
    reports = [r["values"] for r in _reports(path) if f"lightning/{name}" in r["values"]]
    assert [{n: values[f"lightning/{n}"] for n in names} for values in reports] == [
        {n: pytest.approx(logged[n], rel=1e-6) for n in names} for logged in recording.logged
    ]
    for values, step in zip(reports, range(EVERY, STEPS + 1, EVERY), strict=True):
        losses = model.losses[step - EVERY : step]
        assert values["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6), "the callback's"
        assert values[f"lightning/{name}"] == pytest.approx(2 * losses[-1], rel=1e-6), "the module's"
    errors = [r["values"]["exporter/errors"]["prometheus"] for r in _reports(path)]
    assert errors and not any(errors), "no name collides in the Prometheus exposition"
    for series in (
        "torchtelemetry_lightning_train_loss",
        "torchtelemetry_lightning_epoch",
        "torchtelemetry_train_loss",
    ):
        assert f"{series}{{" in scrape.body, series


def test_a_log_prefix_that_collides_with_the_runs_metrics_is_refused_at_set_up(tmp_path) -> None:
    for prefix, match in (
        ("", "must not be empty"),
        ("train/", r"already has metrics there \(\[.*'train/examples'"),
    ):
        callback = LightningTelemetryCallback({"train/examples": SumMetric(kind="counter")}, [], every=EVERY)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=2,
            callbacks=[callback],
            logger=LightningTelemetryLogger(callback, prefix=prefix),
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        with pytest.raises(ValueError, match=match):
            trainer.fit(TinyRegression())
        assert callback.telemetry is None
