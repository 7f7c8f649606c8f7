"""Classification metrics: accuracy, confusion matrix (precision/recall/F1)."""

from __future__ import annotations

from typing import Any

import torch

from torchtelemetry.metric._accumulator import DEFAULT_STATE_DTYPE, MetricAccumulator, ReduceOp
from torchtelemetry.metric._base import Metric, MetricExample
from torchtelemetry.metric._batched import BatchedRule

__all__ = ["AccuracyMetric", "ConfusionMatrixMetric", "confusion_scores"]


class _LabelledMetric(Metric):
    """Shared checks for metrics fed (predictions or logits, integer targets)."""

    num_classes: int | None
    ignore_index: int | None

    def _labels(self, target: Any, device: torch.device) -> torch.Tensor:
        """Integer class labels as int64 (a uint8 label times the class count must not wrap), on
        `device` (the metric's)."""
        if type(target) is torch.Tensor and target.dtype is torch.int64 and target.device == device:
            return target  # the common case: int64 labels on the device (outside autograd, as integers are)
        target = self._as_tensor(target, "target", device)
        if target.is_floating_point() or target.dtype == torch.bool:
            raise TypeError(
                f"{self.display_name()}: target must hold integer class labels, got dtype {target.dtype}"
            )
        return target.long()

    def _check_preds(self, preds: torch.Tensor, target: torch.Tensor, logits: bool) -> None:
        """`logits`: whether `preds` are floating point (logits or probabilities), else labels."""
        if logits:
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

    def _begin_labelled(self, preds: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prologue with nan_policy on logits: "error" raises on NaN or Inf; "ignore" gives the
        samples whose logits are all finite (the others are skipped); "propagate" gives None (they
        count as argmax / top-k rank them: NaN above everything)."""
        preds, mask = self._begin_update(preds, "preds", device)
        return preds, None if mask is None else mask.all(dim=-1)

    def _valid(self, target: torch.Tensor, num_classes: int | None) -> torch.Tensor | None:
        """The entries that count, or None when every entry does: not `ignore_index`, and inside
        [0, num_classes). Where values may be read (the CPU) a label outside the range raises, so the
        range needs no mask there; on a device it is masked (no read). Each op launched costs the
        training thread on a GPU: none is spent on a mask of all true."""
        valid = None if self.ignore_index is None else target != self.ignore_index
        if num_classes is None:
            return valid
        if self._inspects_values(target):
            if not target.numel():
                return valid
            labels = target if valid is None else torch.where(valid, target, 0)
            low, high = torch.aminmax(labels)
            if low.tolist() < 0 or high.tolist() >= num_classes:
                raise ValueError(
                    f"{self.display_name()}: target has labels outside [0, {num_classes}); "
                    "set ignore_index for labels to skip"
                )
            return valid
        in_range = target.clamp(0, num_classes - 1) == target
        return in_range if valid is None else valid & in_range


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
        device = self.correct.device
        preds, finite = self._begin_labelled(preds, device)
        target = self._labels(target, device)
        logits = preds.is_floating_point()
        self._check_preds(preds, target, logits)
        if logits:
            classes = preds.shape[-1]
            if self.top_k > classes:
                raise ValueError(f"{self.display_name()}: top_k={self.top_k} exceeds the {classes} classes")
            hit = preds.argmax(dim=-1) == target if self.top_k == 1 else _in_top_k(preds, target, self.top_k)
            num_classes: int | None = classes
            # A top-1 hit is a label equal to a class index: the range mask keeps it, and so does an
            # ignore_index that is no class (the `&` below is a launch on a device).
            ignored = self.ignore_index
            masks_keep_hits = self.top_k == 1 and (ignored is None or not 0 <= ignored < classes)
        elif self.top_k != 1:
            raise ValueError(f"{self.display_name()}: top_k={self.top_k} needs logits, got labels")
        else:
            num_classes = self.num_classes
            hit = preds == target
            masks_keep_hits = False
        valid = self._valid(target, num_classes)
        if finite is not None:
            valid = finite if valid is None else valid & finite
        if valid is None:
            self.correct.add_with_count(hit.sum(dtype=self.correct.dtype), self.total, hit.numel())
            return
        if finite is not None or not masks_keep_hits:  # the NaN mask drops hits too
            hit = hit & valid
        self.correct.add_with_count(
            hit.sum(dtype=self.correct.dtype), self.total, valid.sum(dtype=self.total.dtype)
        )


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
        device = self.device
        preds, finite = self._begin_labelled(preds, device)
        target = self._labels(target, device)
        logits = preds.is_floating_point()
        self._check_preds(preds, target, logits)
        labels = preds.argmax(dim=-1) if logits else preds.long()
        valid = self._valid(target, self.num_classes)
        if finite is not None:
            valid = finite if valid is None else valid & finite
        pred_ok = (labels >= 0) & (labels < self.num_classes)
        if self._inspects_values(labels) and bool((~pred_ok if valid is None else valid & ~pred_ok).any()):
            raise ValueError(
                f"{self.display_name()}: predictions have labels outside [0, {self.num_classes})"
            )
        valid = pred_ok if valid is None else valid & pred_ok
        cells = torch.where(valid, target * self.num_classes + labels, 0)
        self.matrix.add_at_flat(cells, valid.to(self.matrix.dtype))


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
    """Whether each target is among the `k` (> 1) highest logits; ties go to the lower class index
    and NaN ranks above every number (`argmax`'s order, which gives top-1). Targets outside `[0, C)`
    give an arbitrary answer: the caller masks them."""
    index = target.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
    own = logits.gather(-1, index)
    nan, own_nan = logits.isnan(), own.isnan()
    earlier = torch.arange(logits.shape[-1], device=logits.device) < index
    above = ~own_nan & ((logits > own) | nan)
    tied = torch.where(own_nan, nan, logits == own) & earlier
    return (above | tied).sum(dim=-1) < k
