"""Small helpers shared by the model's modules: parameter-free RMSNorm and the nanochat-style uniform init."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (pre-norm, QK-norm, final norm)."""
    return F.rms_norm(x, (x.shape[-1],))


def init_linear_uniform(linear: nn.Linear, std: float) -> None:
    """Uniform init with the given std (bound sqrt(3)·std), as nanochat does for input projections."""
    bound = math.sqrt(3.0) * std
    nn.init.uniform_(linear.weight, -bound, bound)
