"""Is a confidence a probability? Reliability bins, expected calibration error, Brier score and AUROC of
predicted probabilities against what happened — shared by DSpark's confidence head (drafters.dflash) and
EAGLE-2's path confidence (drafters.eagle.path_outcomes)."""

from __future__ import annotations

import torch


def reliability(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> list[dict]:
    """A reliability diagram's data: equal-width bins of ``pred`` over [0, 1]; per bin its edges, how many
    predictions fell in it and their mean prediction / mean label (None for an empty bin). ``label`` may be
    soft (a probability). pred, label [N]."""
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be an int >= 1, got {bins!r}")
    pred, label = pred.double().flatten(), label.double().flatten()
    if pred.shape != label.shape:
        raise ValueError(f"pred and label need one entry each per outcome: {tuple(pred.shape)} vs {tuple(label.shape)}")
    idx = (pred * bins).long().clamp(0, bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        n = int(m.sum())
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "count": n,
                    "mean_pred": float(pred[m].mean()) if n else None,
                    "mean_label": float(label[m].mean()) if n else None})
    return out


def ece(pred: torch.Tensor, label: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: |mean pred - mean label| per ``reliability`` bin, weighted by bin share."""
    rows = reliability(pred, label, bins)
    total = sum(r["count"] for r in rows)
    if total == 0:
        return 0.0
    return sum(r["count"] / total * abs(r["mean_pred"] - r["mean_label"]) for r in rows if r["count"])


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.double() - label.double()) ** 2).mean())


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float | None:
    """Area under the ROC curve for hard 0/1 labels (ties count half); None when one class is absent."""
    pred, label = pred.double().flatten(), label.flatten() > 0.5
    pos, neg = pred[label], pred[~label]
    if len(pos) == 0 or len(neg) == 0:
        return None
    allv = torch.cat([pos, neg])
    ranks = torch.empty_like(allv)
    order = allv.argsort()
    ranks[order] = torch.arange(1, len(allv) + 1, dtype=torch.double)
    for v in allv.unique():  # average ranks over ties
        m = allv == v
        if int(m.sum()) > 1:
            ranks[m] = ranks[m].mean()
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))
