"""Residual-stream geometry through depth, from the model's own statistics (`nagmoe/model/stats.py`) and the
NAG gates' realised gains.

Legend: B batch, T sequence; sublayer k = NAG sublayer l = k + 1 (block k // 2; attention when k is even).

- Norm curve (L + 1 points: the encoded stream, then after each sublayer):
  pre-norm: the mean stream RMS; NAG: rho = exp(mean log-norm s) (the geometric mean of the per-token norms;
  s includes the encode gain). `norm_growth` = last / first.
- Rotation: the mean angle (radians) between the stream before and after each sublayer; the cumulative
  rotation is its running sum (0 at the embedding).
- Gates (NAG): alpha, beta, the mean realised gain |alpha·m·warmup|, and per token the fractions "dead"
  (gain < 0.05) and "on" (gain > 0.25); a sublayer is dead when its *mean* gain is < 0.05 (the
  reimplementation's gate-health statistics). Depth-quartile means summarise them.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

DEAD_GAIN, ON_GAIN = 0.05, 0.25
MIN_KEYS = ("m_min",)  # per-sublayer statistics whose batch aggregate is a minimum, not a mean


class StatsAverager:
    """Token-weighted mean over batches of the per-sublayer lists and scalars of ModelOutput.stats."""

    def __init__(self):
        self.sums: dict = {}
        self.weight = 0

    def add(self, stats: dict, n_tokens: int) -> None:
        for key, value in stats.items():
            if key in MIN_KEYS:
                prev = self.sums.get(key)
                self.sums[key] = list(value) if prev is None else [min(a, b) for a, b in zip(prev, value)]
            elif isinstance(value, list):
                prev = self.sums.get(key, [0.0] * len(value))
                self.sums[key] = [a + b * n_tokens for a, b in zip(prev, value)]
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * n_tokens
        self.weight += n_tokens

    def mean(self) -> dict:
        out = {}
        for key, value in self.sums.items():
            if key in MIN_KEYS:
                out[key] = value
            elif isinstance(value, list):
                out[key] = [v / self.weight for v in value]
            else:
                out[key] = value / self.weight
        return out


class GainAccumulator:
    """Per NAG sublayer: token counts of realised gains below DEAD_GAIN and above ON_GAIN."""

    def __init__(self, n_sublayers: int):
        self.tokens = [0] * n_sublayers
        self.dead = [0] * n_sublayers
        self.on = [0] * n_sublayers

    @torch.no_grad()
    def add(self, index: int, gain_BT: torch.Tensor) -> None:
        g = gain_BT.abs()
        self.tokens[index] += g.numel()
        self.dead[index] += int((g < DEAD_GAIN).sum())
        self.on[index] += int((g > ON_GAIN).sum())

    def fractions(self) -> tuple[list, list]:
        dead = [d / n if n else None for d, n in zip(self.dead, self.tokens)]
        on = [o / n if n else None for o, n in zip(self.on, self.tokens)]
        return dead, on


@torch.no_grad()
def realised_gain(model, index: int, m_BT: torch.Tensor) -> torch.Tensor:
    """g = alpha·m·warmup of NAG sublayer `index` for each token, from its modulator m (the stream's scale)."""
    stream = model.stream
    return stream.gates[index].alpha.float() * m_BT.float() * stream.injection_warmup


def norm_curve(stats: dict, residual: str) -> list[float]:
    """L + 1 norms: before the first sublayer, then after each (see the module docstring)."""
    if residual == "nag":
        return [math.exp(v) for v in [stats["log_norm_in"][0], *stats["log_norm_out"]]]
    return [stats["stream_rms_in"][0], *stats["stream_rms_out"]]


def cumulative_rotation(angles: list) -> list[float]:
    """[0, a0, a0 + a1, ...]: the running sum of per-sublayer rotation angles (radians)."""
    return [0.0, *np.cumsum(np.asarray(angles, dtype=np.float64)).tolist()]


def quartile_means(values: list) -> list[Optional[float]]:
    """Means over 4 contiguous depth groups (np.array_split sizes), ignoring None."""
    groups = np.array_split(np.arange(len(values)), 4)
    out = []
    for g in groups:
        known = [values[i] for i in g if values[i] is not None]
        out.append(float(np.mean(known)) if known else None)
    return out


def depth_report(stats: dict, residual: str, gains: Optional[GainAccumulator] = None) -> dict:
    """The depth section of the analysis JSON from averaged stats (and NAG token-level gains)."""
    angles = stats["rotation_angle"]
    n = len(angles)
    curve = norm_curve(stats, residual)
    out = {
        "norm_curve": curve,
        "norm_curve_kind": "rho = exp(mean log-norm)" if residual == "nag" else "mean stream RMS",
        "norm_growth": curve[-1] / curve[0] if curve[0] else None,
        "log_norm_curve": [stats["log_norm_in"][0], *stats["log_norm_out"]],
        "rotation_per_sublayer": angles,
        "cumulative_rotation": cumulative_rotation(angles),
    }
    rows = []
    for k in range(n):
        row = {"index": k, "block": k // 2, "kind": "attention" if k % 2 == 0 else "ffn",
               "norm_out": curve[k + 1], "rotation": angles[k]}
        for key in ("alpha", "beta", "gain_mean", "m_mean", "m_min", "m_floor_frac"):
            if key in stats:
                row[key] = stats[key][k]
        rows.append(row)
    if residual == "nag":
        gain = stats["gain_mean"]
        out["dead_sublayers"] = sum(g < DEAD_GAIN for g in gain)
        out["dead_sublayer_fraction"] = out["dead_sublayers"] / n
        out["quartiles"] = {"gain_mean": quartile_means(gain), "alpha": quartile_means(stats["alpha"])}
        if gains is not None:
            dead, on = gains.fractions()
            for k, row in enumerate(rows):
                row["dead_frac"], row["on_frac"] = dead[k], on[k]
            out["quartiles"].update(dead_frac=quartile_means(dead), on_frac=quartile_means(on))
        for key in ("g_encode", "injection_warmup"):
            if key in stats:
                out[key] = stats[key]
    out["sublayers"] = rows
    return out
