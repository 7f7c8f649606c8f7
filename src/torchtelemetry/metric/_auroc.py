"""`BinaryAUROCMetric`: the area under the ROC curve from binned score histograms."""

from __future__ import annotations

from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricExample
from torchtelemetry.metric._batched import BatchedRule, States

__all__ = ["BinaryAUROCMetric"]


def _auroc(states: States, constants: None) -> torch.Tensor:
    """The trapezoid rule over the binned ROC curves `[..., num_bins]`, thresholds from high to low."""
    tp = states["positives"].flip(-1).cumsum(-1)
    fp = states["negatives"].flip(-1).cumsum(-1)
    zeros = tp.new_zeros((*tp.shape[:-1], 1))
    tpr = torch.cat([zeros, tp / tp[..., -1:]], dim=-1)
    fpr = torch.cat([zeros, fp / fp[..., -1:]], dim=-1)
    return torch.trapezoid(tpr, fpr, dim=-1)


class BinaryAUROCMetric(Metric):
    """Area under the ROC curve from binned score histograms (exact for the binned scores).

    Scores are probabilities in [0, 1] (or logits with `from_logits=True`),
    bucketed into `num_bins` equal bins per class; ties inside a bin count half,
    as in the exact AUROC. `compute()`: the AUROC by the trapezoid rule over thresholds from high to
    low; NaN with one class only.

    Example:
        >>> metric = BinaryAUROCMetric()
        >>> metric.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute().item()
        0.75
    """

    batched = BatchedRule(_auroc)

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        scores, labels = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.6]), torch.tensor([0, 0, 1, 1, 0])
        return (
            MetricExample("probabilities", (scores, labels), (torch.tensor([0.9]), torch.tensor([1]))),
            MetricExample("logits and bool target", (torch.logit(scores), labels.bool()), from_logits=True),
        )

    def __init__(
        self,
        *,
        num_bins: int = 1024,
        from_logits: bool = False,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if num_bins < 2:
            raise ValueError(f"{self.display_name()}: num_bins must be at least 2, got {num_bins}")
        self.num_bins = num_bins
        self.from_logits = from_logits
        self.positives = MetricAccumulator(torch.zeros(num_bins), ReduceOp.SUM, dtype=dtype)
        self.negatives = MetricAccumulator(torch.zeros(num_bins), ReduceOp.SUM, dtype=dtype)

    def configuration(self) -> dict[str, Any]:
        return {**super().configuration(), "num_bins": self.num_bins, "from_logits": self.from_logits}

    def update(self, preds: Any, target: Any) -> None:
        """Add scores `preds` with binary labels `target` (0/1 integers or booleans)."""
        preds, _ = self._begin_update(preds, "preds")  # non-finite scores are never counted
        target = self._as_tensor(target, "target")
        if not preds.is_floating_point():
            raise TypeError(f"{self.display_name()}: preds must be floating point scores, got {preds.dtype}")
        if target.is_floating_point():
            raise TypeError(
                f"{self.display_name()}: target must be 0/1 integers or booleans, got {target.dtype}"
            )
        if preds.shape != target.shape:
            raise ValueError(
                f"{self.display_name()}: preds have shape {tuple(preds.shape)}, target {tuple(target.shape)}"
            )
        if self._inspects_values(target) and bool(((target != 0) & (target != 1)).any()):
            raise ValueError(f"{self.display_name()}: target must be 0 or 1")
        scores = torch.sigmoid(preds) if self.from_logits else preds
        valid = torch.isfinite(scores)
        bins = (scores.nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp_(max=self.num_bins - 1)
        positive = (target != 0) & valid
        negative = (target == 0) & valid
        self.positives.add_at_flat(bins, positive.to(self.positives.dtype))
        self.negatives.add_at_flat(bins, negative.to(self.negatives.dtype))
