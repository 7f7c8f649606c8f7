"""A 2-process Hugging Face Trainer run with TrainerTelemetryCallback; launched by torchrun from the test."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from torchtelemetry import JsonlExporter, MaxMetric, PrometheusExporter, SumMetric, WeightedMeanMetric
from torchtelemetry.integrations import TrainerTelemetryCallback

STEPS = 6
LOGGING_STEPS = 2
VOCAB = 64
LENGTH = 8


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (size, LENGTH), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        labels = self.ids[index].clone()
        labels[0] = -100  # predicts nothing: kept out of the Trainer's token count (num_items_in_batch)
        return {"input_ids": self.ids[index], "labels": labels}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=LENGTH))
    metrics = {
        "train/token_loss": WeightedMeanMetric(),
        "train/label_tokens": SumMetric(kind="counter"),
        "train/max_token_loss": MaxMetric(),
    }
    records: list[dict[str, float]] = []

    def loss_and_metrics(outputs, labels, num_items_in_batch=None) -> torch.Tensor:
        token_loss = F.cross_entropy(
            outputs.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="none"
        )
        if model.training:
            detached = token_loss.detach()
            metrics["train/token_loss"].update(detached)
            metrics["train/label_tokens"].update(torch.tensor(float(detached.numel())))
            metrics["train/max_token_loss"].update(detached.max())
            records.append(
                {"sum": detached.sum().item(), "count": detached.numel(), "max": detached.max().item()}
            )
        # The Trainer multiplies the loss by the number of processes (it expects a sum over the step's
        # label tokens on every process, num_items_in_batch): a local mean would be logged twice too big.
        return token_loss.sum() / num_items_in_batch

    prometheus = PrometheusExporter(port=0)
    callback = TrainerTelemetryCallback(
        metrics, [JsonlExporter(out / f"telemetry-rank{rank}.jsonl"), prometheus], run_id="hf-test"
    )
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        logging_steps=LOGGING_STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="linear",  # a new learning rate every step
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(2 * 2 * STEPS, seed=1),
        eval_dataset=TokenDataset(4, seed=2),
        compute_loss_func=loss_and_metrics,
    )
    trainer.add_callback(callback)
    trainer.train()
    eval_metrics = trainer.evaluate()
    callback.telemetry.flush()
    scraped = urllib.request.urlopen(prometheus.url).read().decode() if prometheus.url else ""
    errors = {name: health.errors for name, health in callback.telemetry.hub.health().items()}
    callback.close()
    result = {
        "records": records,
        "log_history": trainer.state.log_history,
        "eval": eval_metrics,
        "scraped": scraped,
        "errors": errors,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
