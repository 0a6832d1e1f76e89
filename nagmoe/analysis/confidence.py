"""Confidence signals against what the model gets right: tokens binned by a per-token signal, with the mean
next-token loss and top-1 accuracy per bin and Spearman rank correlations.

Signals: the final NAG log-norm s_L (the decode's inverse temperature, NAG runs only) and, for every model, the
entropy of the output distribution H = logsumexp(z) - Σ softmax(z)·z (nats).

Bins hold equal numbers of tokens (quantiles of the signal, ties split by sort order). Spearman's rho is the
Pearson correlation of average ranks (ties share their mean rank), so a binary "top-1 correct" works too; a
constant input gives None (undefined).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """H (B, T) in nats, fp32."""
    z = logits_BTV.float()
    log_p = torch.log_softmax(z, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values get the mean of their ranks."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sorted_x = x[order]
    boundaries = np.flatnonzero(np.diff(sorted_x)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(x)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = 0.5 * (s + e - 1) + 1.0
    return ranks


def spearman(x, y) -> Optional[float]:
    """Spearman's rank correlation (None when either side is constant or there are < 2 points)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else None


def binned(signal, loss, correct, n_bins: int = 10) -> list[dict]:
    """Equal-count bins of `signal` (ascending): range, mean signal, mean loss, top-1 accuracy, tokens."""
    signal = np.asarray(signal, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    correct = np.asarray(correct, dtype=np.float64)
    order = np.argsort(signal, kind="mergesort")
    out = []
    for idx in np.array_split(order, min(n_bins, len(order))):
        if len(idx) == 0:
            continue
        out.append({"lo": float(signal[idx].min()), "hi": float(signal[idx].max()),
                    "mean": float(signal[idx].mean()), "tokens": int(len(idx)),
                    "loss": float(loss[idx].mean()), "top1_acc": float(correct[idx].mean())})
    return out


def confidence_report(signal, loss, correct, n_bins: int = 10) -> dict:
    """Bins and Spearman correlations of one signal against per-token loss and top-1 correctness."""
    return {"bins": binned(signal, loss, correct, n_bins),
            "spearman_loss": spearman(signal, loss),
            "spearman_top1": spearman(signal, correct),
            "tokens": int(len(np.asarray(signal)))}


class TokenRecords:
    """Per-token signals gathered over batches (CPU, fp32)."""

    def __init__(self):
        self.parts: dict[str, list] = {}

    def add(self, **values_BT: torch.Tensor) -> None:
        for key, v in values_BT.items():
            self.parts.setdefault(key, []).append(v.detach().float().flatten().cpu())

    def get(self, key: str) -> Optional[np.ndarray]:
        if key not in self.parts:
            return None
        return torch.cat(self.parts[key]).numpy()
