"""Dense feed-forward sublayer: c_fc -> ReLU² -> c_proj (zero-init), no biases.

Legend: B batch, T sequence, D model width, F hidden width.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from nagmoe.model.common import init_linear_uniform
from nagmoe.model.init_rng import ParamInit
from nagmoe.model.mod import decide
from nagmoe.ops.activations import relu_squared


class DenseMLP(nn.Module):
    """y = c_proj(relu(c_fc(x))²); hidden defaults to 4·d. Returns (y, None), the sublayer call shape. Under static
    MoD (`select`, a nagmoe.model.mod.Selection) every token is computed; the forward only makes the decision,
    so a compiled FFN makes it inside its unit."""

    def __init__(self, d_model: int, hidden: Optional[int] = None, init_std: Optional[float] = None):
        super().__init__()
        self.hidden = hidden or 4 * d_model
        self.init_std = init_std if init_std is not None else d_model ** -0.5
        self.c_fc = nn.Linear(d_model, self.hidden, bias=False)
        self.c_proj = nn.Linear(self.hidden, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weights(ParamInit())

    def init_weights(self, init: ParamInit) -> None:
        init_linear_uniform(self, "c_fc", self.init_std, init)
        init.zeros_(self, "c_proj.weight")

    def forward(self, x_BTD: torch.Tensor, select=None):
        decide(select)
        h_BTF = relu_squared(self.c_fc(x_BTD))  # r·r: no fp32 pow under CUDA autocast
        return self.c_proj(h_BTF), None
