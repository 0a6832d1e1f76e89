"""Residual-stream statistics, gathered during one forward when asked for (off by default, free when off).

The residual streams call `StatsCollector.add_sublayer(...)` once per sublayer, in order, and `add_scalar`
for per-model values; `as_dict()` gives python floats and lists (element k of a list = sublayer k, i.e.
NAG sublayer index l = k + 1: attention of block i at k = 2i, its FFN at k = 2i + 1).

Keys, both residuals:  log_norm_in, log_norm_out  (mean over tokens of log RMS of the stream; for NAG the
                       log-norm lane s), rotation_angle (mean angle in radians between the stream before and
                       after the sublayer).
Prenorm only:          stream_rms_in, stream_rms_out (mean RMS of the stream).
NAG only:              alpha, beta (softplus(beta_raw)), m_mean, m_min, m_floor_frac (fraction of tokens whose
                       modulator base sits at the floor), gain_mean (mean |alpha·m·warmup|, the realised
                       scale); scalars g_encode and injection_warmup.
"""
from __future__ import annotations

import torch


class StatsCollector:
    def __init__(self):
        self.sublayers: dict[str, list[float]] = {}
        self.scalars: dict[str, float] = {}

    def add_sublayer(self, **values) -> None:
        for key, value in values.items():
            self.sublayers.setdefault(key, []).append(_to_float(value))

    def add_scalar(self, **values) -> None:
        for key, value in values.items():
            self.scalars[key] = _to_float(value)

    def as_dict(self) -> dict:
        return {**self.sublayers, **self.scalars}


def _to_float(value) -> float:
    return float(value.detach().float().item()) if isinstance(value, torch.Tensor) else float(value)


@torch.no_grad()
def mean_angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the angle between a and b (last dim), in fp32. Uses 2·atan2(|â - b̂|, |â + b̂|),
    accurate near 0 where arccos of the cosine is not."""
    a_hat = torch.nn.functional.normalize(a.float(), dim=-1)
    b_hat = torch.nn.functional.normalize(b.float(), dim=-1)
    return (2 * torch.atan2((a_hat - b_hat).norm(dim=-1), (a_hat + b_hat).norm(dim=-1))).mean()


@torch.no_grad()
def mean_rms(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1).sqrt().mean()


@torch.no_grad()
def mean_log_rms(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.log(x.float().pow(2).mean(-1)).mean()
