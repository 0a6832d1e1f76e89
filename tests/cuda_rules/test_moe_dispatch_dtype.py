"""The MoE dispatch casts to the experts' compute dtype before it copies tokens into slots (issue 38): under CUDA's
rules no fp32 tensor of N·K slot rows exists in the layer's forward or backward (before: the fp32 carrier was
expanded, copied and permuted, and under expert parallelism shipped, at 4 bytes a value)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nagmoe.config import MoEConfig
from nagmoe.cuda_rules.tier import cuda_rules_autocast
from nagmoe.model.moe import MoELayer

N, D, E, H = 64, 32, 4, 16  # E·H < N·K: a weight (E, H, D) is never mistaken for slot rows


class Fp32Rows(TorchDispatchMode):
    """The most rows of width D in any fp32 tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] == D:
                self.rows = max(self.rows, t.numel() // D)
        return out


@pytest.mark.parametrize("K,capacity", [(2, None), (3, None), (2, 1.0)])
def test_no_fp32_slot_copy(K, capacity):
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl="grouped", capacity_factor=capacity))
    x = torch.randn(1, N, D, requires_grad=True)
    seen = Fp32Rows()
    with seen:
        with cuda_rules_autocast("2.11"):
            y, aux = layer(x)
        y.sum().backward()
    assert seen.rows == N  # the carrier, the combine's sum and their gradients: N rows, never N·K
    assert torch.isfinite(x.grad).all()
