"""Classification metrics: accuracy, confusion matrix (precision/recall/F1), binary AUROC."""

from __future__ import annotations

from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric

__all__ = ["AccuracyMetric", "BinaryAUROCMetric", "ConfusionMatrixMetric"]


class _LabelledMetric(Metric):
    """Shared checks for metrics fed (predictions or logits, integer targets)."""

    num_classes: int | None
    ignore_index: int | None

    def _labels(self, target: Any) -> torch.Tensor:
        target = self._as_tensor(target, "target")
        if target.is_floating_point() or target.dtype == torch.bool:
            raise TypeError(
                f"{self.display_name()}: target must hold integer class labels, got dtype {target.dtype}"
            )
        return target

    def _num_classes(self, preds: torch.Tensor) -> int | None:
        return preds.shape[-1] if preds.is_floating_point() else self.num_classes

    def _check_preds(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.is_floating_point():
            if preds.dim() != target.dim() + 1 or preds.shape[:-1] != target.shape:
                raise ValueError(
                    f"{self.display_name()}: logits have shape {tuple(preds.shape)}, expected "
                    f"{tuple(target.shape)} + (num_classes,) to match target"
                )
            if self.num_classes is not None and preds.shape[-1] != self.num_classes:
                raise ValueError(
                    f"{self.display_name()}: logits have {preds.shape[-1]} classes, "
                    f"expected {self.num_classes}"
                )
        elif preds.dtype == torch.bool or preds.shape != target.shape:
            raise ValueError(
                f"{self.display_name()}: label predictions have shape {tuple(preds.shape)} and dtype "
                f"{preds.dtype}, expected integer labels of the target's shape {tuple(target.shape)}"
            )

    def _finite_rows(self, preds: torch.Tensor) -> torch.Tensor | None:
        """nan_policy on logits: "error" raises on NaN or Inf; "ignore" gives the samples whose
        logits are all finite (the others are skipped); "propagate" gives None (they count as
        argmax / top-k rank them: NaN above everything)."""
        self._check_finite(preds, "preds")
        mask = self._finite_mask(preds)
        return None if mask is None else mask.all(dim=-1)

    def _valid(self, target: torch.Tensor, num_classes: int | None) -> torch.Tensor:
        """Entries that count: not `ignore_index`, and (device-side) inside [0, num_classes)."""
        valid = torch.ones_like(target, dtype=torch.bool)
        if self.ignore_index is not None:
            valid = target != self.ignore_index
        if num_classes is not None:
            in_range = (target >= 0) & (target < num_classes)
            if self._inspects_values(target) and bool((valid & ~in_range).any()):
                raise ValueError(
                    f"{self.display_name()}: target has labels outside [0, {num_classes}); "
                    "set ignore_index for labels to skip"
                )
            valid = valid & in_range
        return valid


class AccuracyMetric(_LabelledMetric):
    """Multiclass accuracy from logits (`[..., C]`, top-k) or from predicted labels."""

    def __init__(
        self,
        *,
        top_k: int = 1,
        ignore_index: int | None = None,
        num_classes: int | None = None,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if top_k < 1:
            raise ValueError(f"{self.display_name()}: top_k must be at least 1, got {top_k}")
        self.top_k = top_k
        self.ignore_index = ignore_index
        self.num_classes = num_classes
        self.correct = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)
        self.total = MetricAccumulator(0, ReduceOp.SUM, dtype=dtype)

    def update(self, preds: Any, target: Any) -> None:
        """Count correct predictions; `preds` are logits/probabilities or integer labels."""
        if not torch.compiler.is_compiling():
            self._check_thread()
        preds = self._as_tensor(preds, "preds")
        target = self._labels(target)
        self._check_preds(preds, target)
        finite = self._finite_rows(preds)
        num_classes = self._num_classes(preds)
        if preds.is_floating_point():
            if self.top_k > preds.shape[-1]:
                raise ValueError(
                    f"{self.display_name()}: top_k={self.top_k} exceeds the {preds.shape[-1]} classes"
                )
            top = preds.topk(self.top_k, dim=-1).indices
            hit = (top == target.unsqueeze(-1)).any(dim=-1)
        elif self.top_k != 1:
            raise ValueError(f"{self.display_name()}: top_k={self.top_k} needs logits, got labels")
        else:
            hit = preds == target
        valid = self._valid(target, num_classes)
        if finite is not None:
            valid = valid & finite
        self.correct.update((hit & valid).sum(dtype=self.correct.dtype))
        self.total.update(valid.sum(dtype=self.total.dtype))

    def compute(self) -> torch.Tensor:
        """Fraction correct; NaN when nothing was counted."""
        return self.correct.value / self.total.value


class ConfusionMatrixMetric(_LabelledMetric):
    """Confusion matrix (rows: target, columns: prediction) with precision, recall and F1."""

    label_name = "class"

    def __init__(
        self,
        num_classes: int,
        *,
        ignore_index: int | None = None,
        dtype: torch.dtype = DEFAULT_STATE_DTYPE,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if num_classes < 2:
            raise ValueError(f"{self.display_name()}: num_classes must be at least 2, got {num_classes}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.matrix = MetricAccumulator(torch.zeros(num_classes, num_classes), ReduceOp.SUM, dtype=dtype)

    def update(self, preds: Any, target: Any) -> None:
        """Count (target, prediction) pairs; `preds` are logits or integer labels."""
        if not torch.compiler.is_compiling():
            self._check_thread()
        preds = self._as_tensor(preds, "preds")
        target = self._labels(target)
        self._check_preds(preds, target)
        finite = self._finite_rows(preds)
        labels = preds.argmax(dim=-1) if preds.is_floating_point() else preds
        valid = self._valid(target, self.num_classes)
        if finite is not None:
            valid = valid & finite
        pred_ok = (labels >= 0) & (labels < self.num_classes)
        if self._inspects_values(labels) and bool((valid & ~pred_ok).any()):
            raise ValueError(
                f"{self.display_name()}: predictions have labels outside [0, {self.num_classes})"
            )
        valid = valid & pred_ok
        cells = torch.where(valid, target * self.num_classes + labels, 0).reshape(-1)
        counts = torch.zeros(self.num_classes**2, dtype=self.matrix.dtype, device=cells.device)
        counts.index_add_(0, cells, valid.reshape(-1).to(counts.dtype))
        self.matrix.update(counts.view(self.num_classes, self.num_classes))

    def compute(self) -> dict[str, torch.Tensor]:
        """Per-class and macro precision, recall and F1 (0 where undefined)."""
        matrix = self.matrix.value
        true_positive = matrix.diagonal()
        precision = _safe_ratio(true_positive, matrix.sum(dim=0))
        recall = _safe_ratio(true_positive, matrix.sum(dim=1))
        f1 = _safe_ratio(2 * precision * recall, precision + recall)
        return {
            "precision": precision,
            "recall": recall,
            "f1": f1,
            "macro_precision": precision.mean(),
            "macro_recall": recall.mean(),
            "macro_f1": f1.mean(),
        }


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), 0)


class BinaryAUROCMetric(Metric):
    """Area under the ROC curve from binned score histograms (exact for the binned scores).

    Scores are probabilities in [0, 1] (or logits with `from_logits=True`),
    bucketed into `num_bins` equal bins per class; ties inside a bin count half,
    as in the exact AUROC.
    """

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

    def update(self, preds: Any, target: Any) -> None:
        """Add scores `preds` with binary labels `target` (0/1 integers or booleans)."""
        if not torch.compiler.is_compiling():
            self._check_thread()
        preds = self._as_tensor(preds, "preds")
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
        self._check_finite(preds, "preds")
        scores = torch.sigmoid(preds) if self.from_logits else preds
        valid = torch.isfinite(scores)
        bins = (scores.nan_to_num(0.0).clamp(0, 1) * self.num_bins).long().clamp_(max=self.num_bins - 1)
        positive = (target != 0) & valid
        negative = (target == 0) & valid
        bins = bins.reshape(-1)
        dtype, device = self.positives.dtype, bins.device
        pos = torch.zeros(self.num_bins, dtype=dtype, device=device)
        neg = torch.zeros(self.num_bins, dtype=dtype, device=device)
        pos.index_add_(0, bins, positive.reshape(-1).to(dtype))
        neg.index_add_(0, bins, negative.reshape(-1).to(dtype))
        self.positives.update(pos)
        self.negatives.update(neg)

    def compute(self) -> torch.Tensor:
        """AUROC by the trapezoid rule over thresholds from high to low; NaN with one class only."""
        tp = self.positives.value.flip(0).cumsum(0)
        fp = self.negatives.value.flip(0).cumsum(0)
        tpr = torch.cat([tp.new_zeros(1), tp / tp[-1]])
        fpr = torch.cat([fp.new_zeros(1), fp / fp[-1]])
        return torch.trapezoid(tpr, fpr)
