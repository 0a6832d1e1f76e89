"""Small helpers shared by the model's modules: parameter-free RMSNorm and the nanochat-style uniform init."""
from __future__ import annotations

import math
from typing import Optional

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


def recording(ran: Optional[dict]) -> Optional[dict]:
    """A module's record of the kernels it ran (`module.ran`, read by nagmoe.train.backends_ran), or None inside a
    compiled graph: dynamo guards on a dict that a trace mutates (one recompile per new value), and the graph's
    kernels are the compiler's choice; backends_ran names those "in the compiled graph"."""
    return None if ran is None or torch.compiler.is_compiling() else ran
