"""Small helpers shared by the model's modules: parameter-free RMSNorm and the nanochat-style uniform init."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (pre-norm, QK-norm, final norm)."""
    return F.rms_norm(x, (x.shape[-1],))


def init_linear_uniform(module: nn.Module, linear: str, std: float, init) -> None:
    """Uniform init of `module.<linear>.weight` with the given std (bound sqrt(3)·std), as nanochat does for
    input projections; `init` a nagmoe.model.init_rng.ParamInit."""
    init.uniform_(module, f"{linear}.weight", math.sqrt(3.0) * std)
