"""Classification metrics: accuracy, confusion matrix (precision/recall/F1), binary AUROC."""

from __future__ import annotations

from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricExample
from torchtelemetry.metric._batched import BatchedRule, States

__all__ = ["AccuracyMetric", "BinaryAUROCMetric", "ConfusionMatrixMetric", "confusion_scores"]


class _LabelledMetric(Metric):
    """Shared checks for metrics fed (predictions or logits, integer targets)."""

    num_classes: int | None
    ignore_index: int | None

    def _labels(self, target: Any) -> torch.Tensor:
        """Integer class labels as int64 (a uint8 label times the class count must not wrap)."""
        target = self._as_tensor(target, "target")
        if target.is_floating_point() or target.dtype == torch.bool:
            raise TypeError(
                f"{self.display_name()}: target must hold integer class labels, got dtype {target.dtype}"
            )
        return target.long()

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

    def _begin_labelled(self, preds: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prologue with nan_policy on logits: "error" raises on NaN or Inf; "ignore" gives the
        samples whose logits are all finite (the others are skipped); "propagate" gives None (they
        count as argmax / top-k rank them: NaN above everything)."""
        preds, mask = self._begin_update(preds, "preds")
        return preds, None if mask is None else mask.all(dim=-1)

    def _valid(self, target: torch.Tensor, num_classes: int | None) -> torch.Tensor:
        """Entries that count: not `ignore_index`, and (device-side) inside [0, num_classes). Each
        kernel launch costs the training thread on a GPU: none is spent on an all-true mask."""
        valid = None if self.ignore_index is None else target != self.ignore_index
        if num_classes is not None:
            in_range = (target >= 0) & (target < num_classes)
            if self._inspects_values(target) and bool(
                (~in_range if valid is None else valid & ~in_range).any()
            ):
                raise ValueError(
                    f"{self.display_name()}: target has labels outside [0, {num_classes}); "
                    "set ignore_index for labels to skip"
                )
            valid = in_range if valid is None else valid & in_range
        return torch.ones_like(target, dtype=torch.bool) if valid is None else valid


class AccuracyMetric(_LabelledMetric):
    """Multiclass accuracy from logits (`[..., C]`, top-k) or from predicted labels.

    Top-1 is the `argmax` of the logits, as in `ConfusionMatrixMetric`, torchmetrics and
    scikit-learn: among tied logits the lowest class index wins. With `top_k` > 1, ties at the
    k-th place go to the lower class indices the same way. NaN ranks above every number.
    `compute()`: the fraction correct; NaN when nothing was counted.

    Example:
        >>> metric = AccuracyMetric()
        >>> metric.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        >>> metric.compute().item()
        0.5
    """

    batched = BatchedRule(lambda states, _: states["correct"] / states["total"])

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        logits = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 0.4], [0.3, 0.1, 0.9], [0.2, 0.8, 0.5]])
        return (
            MetricExample("logits", (logits, torch.tensor([1, 0, 1, 2])), (logits[:1], torch.tensor([1]))),
            MetricExample("top-2 logits", (logits, torch.tensor([2, 1, 0, 2])), top_k=2),
            MetricExample("sequence logits", (logits.reshape(2, 2, 3), torch.tensor([[1, 0], [2, 0]]))),
            MetricExample("labels", (torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 2, 1])), num_classes=3),
            MetricExample("ignore_index", (logits, torch.tensor([1, -100, 2, 1])), ignore_index=-100),
            MetricExample(
                "ignore NaN logits",
                (torch.tensor([[0.1, float("nan"), 0.3], [1.5, 0.2, 0.4]]), torch.tensor([1, 0])),
                nan_policy="ignore",
            ),
        )

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

    def configuration(self) -> dict[str, Any]:
        return {
            **super().configuration(),
            "top_k": self.top_k,
            "num_classes": self.num_classes,
            "ignore_index": self.ignore_index,
        }

    def update(self, preds: Any, target: Any) -> None:
        """Count correct predictions; `preds` are logits/probabilities or integer labels."""
        preds, finite = self._begin_labelled(preds)
        target = self._labels(target)
        self._check_preds(preds, target)
        num_classes = self._num_classes(preds)
        if preds.is_floating_point():
            if self.top_k > preds.shape[-1]:
                raise ValueError(
                    f"{self.display_name()}: top_k={self.top_k} exceeds the {preds.shape[-1]} classes"
                )
            hit = _in_top_k(preds, target, self.top_k)
        elif self.top_k != 1:
            raise ValueError(f"{self.display_name()}: top_k={self.top_k} needs logits, got labels")
        else:
            hit = preds == target
        valid = self._valid(target, num_classes)
        if finite is not None:
            valid = valid & finite
        self.correct.update((hit & valid).sum(dtype=self.correct.dtype))
        self.total.update(valid.sum(dtype=self.total.dtype))


class ConfusionMatrixMetric(_LabelledMetric):
    """Confusion matrix (rows: target, columns: prediction) with precision, recall and F1.

    Per class, a ratio with nothing to divide by is 0. The macro averages are taken over the
    classes that occur in the window (in the targets or the predictions), as torchmetrics'
    `average="macro"` and scikit-learn's do: a class absent from both counts for nothing instead
    of as 0. Predictions from logits are their `argmax` (the lowest class index among ties).
    `compute()`: per-class precision, recall and F1 (0 where undefined) and their macro averages
    over the classes that occur (0 when none does).

    Example:
        >>> metric = ConfusionMatrixMetric(num_classes=2)
        >>> metric.update(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))  # labels
        >>> metric.matrix.value.tolist()
        [[1.0, 1.0], [0.0, 2.0]]
        >>> scores = metric.compute()
        >>> scores["recall"].tolist(), scores["macro_precision"].item()
        ([0.5, 1.0], 0.8333333333333333)
    """

    label_name = "class"
    batched = BatchedRule(lambda states, _: confusion_scores(states["matrix"]))

    @classmethod
    def examples(cls) -> tuple[MetricExample, ...]:
        logits = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 0.4], [0.3, 0.1, 0.9], [0.2, 0.8, 0.5]])
        labels = (torch.tensor([0, 2, 1, 1]), torch.tensor([0, 1, 1, 2]))
        return (
            MetricExample("logits", (logits, torch.tensor([1, 0, 1, 2])), num_classes=3),
            MetricExample("labels", labels, labels, num_classes=3),
            MetricExample(
                "ignore_index",
                (torch.tensor([0, 1, 2]), torch.tensor([0, -100, 2])),
                num_classes=3,
                ignore_index=-100,
            ),
        )

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

    def configuration(self) -> dict[str, Any]:
        return {**super().configuration(), "num_classes": self.num_classes, "ignore_index": self.ignore_index}

    def update(self, preds: Any, target: Any) -> None:
        """Count (target, prediction) pairs; `preds` are logits or integer labels."""
        preds, finite = self._begin_labelled(preds)
        target = self._labels(target)
        self._check_preds(preds, target)
        labels = preds.argmax(dim=-1) if preds.is_floating_point() else preds.long()
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


def confusion_scores(matrix: torch.Tensor) -> dict[str, torch.Tensor]:
    """Precision, recall, F1 and their macro averages from confusion matrices `[..., C, C]`."""
    true_positive = matrix.diagonal(dim1=-2, dim2=-1)
    predicted, actual = matrix.sum(dim=-2), matrix.sum(dim=-1)
    precision = _safe_ratio(true_positive, predicted)
    recall = _safe_ratio(true_positive, actual)
    f1 = _safe_ratio(2 * precision * recall, precision + recall)
    # A class absent from targets and predictions scores 0 on all three: summing over every class
    # and dividing by the classes that occur averages over those.
    occurring = ((predicted + actual) > 0).sum(dim=-1, dtype=precision.dtype)
    macro = _safe_ratio(torch.stack([precision, recall, f1], dim=-1).sum(dim=-2), occurring.unsqueeze(-1))
    macro_precision, macro_recall, macro_f1 = macro.unbind(dim=-1)
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "macro_precision": macro_precision,
        "macro_recall": macro_recall,
        "macro_f1": macro_f1,
    }


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), 0)


def _in_top_k(logits: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Whether each target is among the `k` highest logits; ties go to the lower class index and
    NaN ranks above every number (`argmax`'s order, which gives top-1). Targets outside `[0, C)`
    give an arbitrary answer: the caller masks them."""
    if k == 1:
        return logits.argmax(dim=-1) == target
    index = target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    own = logits.gather(-1, index)
    nan, own_nan = logits.isnan(), own.isnan()
    earlier = torch.arange(logits.shape[-1], device=logits.device) < index
    above = ~own_nan & ((logits > own) | nan)
    tied = torch.where(own_nan, nan, logits == own) & earlier
    return (above | tied).sum(dim=-1) < k


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
        bins = bins.reshape(-1)
        dtype, device = self.positives.dtype, bins.device
        pos = torch.zeros(self.num_bins, dtype=dtype, device=device)
        neg = torch.zeros(self.num_bins, dtype=dtype, device=device)
        pos.index_add_(0, bins, positive.reshape(-1).to(dtype))
        neg.index_add_(0, bins, negative.reshape(-1).to(dtype))
        self.positives.update(pos)
        self.negatives.update(neg)
