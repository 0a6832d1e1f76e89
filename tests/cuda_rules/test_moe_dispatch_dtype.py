"""The MoE dispatch casts to the experts' compute dtype before it copies tokens into slots (issue 38): under
autocast (CPU's own lists, and CUDA's rules) no fp32 tensor of N·K slot rows exists in the layer's forward or
backward — before, the fp32 carrier was expanded, copied and permuted (and under expert parallelism shipped) at 4
bytes a value. Without autocast everything stays fp32."""
import pytest
import torch

from nagmoe.config import MoEConfig
from nagmoe.cuda_rules.contracts import LargestRows
from nagmoe.cuda_rules.tier import cuda_rules_autocast
from nagmoe.model.moe import MoELayer

N, D, E, H = 64, 32, 4, 16  # E·H < N·K: a weight (E, H, D) is never mistaken for slot rows

AUTOCASTS = {"cpu-bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
             "cuda-rules-2.11": lambda: cuda_rules_autocast("2.11")}


@pytest.mark.parametrize("autocast", sorted(AUTOCASTS))
@pytest.mark.parametrize("impl,K,capacity", [("grouped", 2, None), ("grouped", 3, None), ("loop", 2, None),
                                             ("grouped", 2, 1.0)])
def test_no_fp32_slot_copy(autocast, impl, K, capacity):
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl=impl, capacity_factor=capacity))
    x = torch.randn(1, N, D, requires_grad=True)
    with LargestRows(D, torch.float32) as seen:
        with AUTOCASTS[autocast]():
            y, _ = layer(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    # the carrier, the combine's sum and their gradients: N rows, never N·K
    assert seen.rows == N, f"an fp32 tensor of {seen.rows} rows x D (N·K = {N * K})"


def test_without_autocast_everything_stays_fp32():
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=2, expert_hidden=H, impl="grouped"))
    x = torch.randn(1, N, D, requires_grad=True)
    with LargestRows(D) as seen:
        y, _ = layer(x)
        y.sum().backward()
    assert y.dtype == torch.float32 and torch.bfloat16 not in seen.dtypes
