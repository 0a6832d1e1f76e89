"""ReLU² keeps its input's dtype under CUDA's rules at all four sites (issue 38): the grouped and loop expert
paths, grouped_gemm's (megablocks) and the dense MLP. Before, `relu(h).square()` became an fp32 `pow` on CUDA: the
next bf16-only grouped GEMM failed, and an fp32 copy of the S x H activation was saved for backward."""
import pytest
import torch

from nagmoe.config import MoEConfig
from nagmoe.cuda_rules.contracts import KernelContracts, SavedActivationCheck, check_gmm_operands
from nagmoe.cuda_rules.tier import cuda_rules_autocast
from nagmoe.model.mlp import DenseMLP
from nagmoe.model.moe import MoELayer, Router

D, E, K, H = 32, 4, 2, 64


def _moe(impl):
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl=impl))
    torch.nn.init.normal_(layer.w_out, std=0.02)
    return layer


def _run_checked(module, x):
    contracts, saved = KernelContracts(), SavedActivationCheck(module, (MoELayer, DenseMLP), (Router,))
    with cuda_rules_autocast("2.11"), saved.active(), contracts:
        y = module(x)[0]
    y.float().sum().backward()
    return y, contracts, saved


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_expert_paths_meet_the_kernel_contracts(impl):
    x = torch.randn(2, 16, D, requires_grad=True)
    y, contracts, saved = _run_checked(_moe(impl), x)
    assert contracts.violations == [] and saved.violations == []
    if impl == "grouped":
        assert contracts.grouped_mm_dtypes == [("bfloat16", "bfloat16")] * 2  # the fast path ran, bf16 x bf16
    assert torch.isfinite(x.grad).all()


def test_dense_mlp_saves_no_fp32_copy():
    mlp = DenseMLP(D)
    torch.nn.init.normal_(mlp.c_proj.weight, std=0.02)
    x = torch.randn(2, 16, D, requires_grad=True)
    y, _, saved = _run_checked(mlp, x)
    assert saved.violations == [] and y.dtype == torch.bfloat16


def test_grouped_gemm_path_gets_bf16():
    from nagmoe.ops.grouped_experts import grouped_gemm_experts  # megablocks' two GEMMs, apart from the import

    def gmm(a, b, batch_sizes, trans_b=False):  # grouped_gemm.ops.gmm's contract, computed per group on the CPU
        check_gmm_operands(a, b)
        ends = torch.cumsum(batch_sizes, 0).tolist()
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))])

    torch.manual_seed(0)
    x = torch.randn(24, D, dtype=torch.bfloat16)
    w_in, w_out = torch.randn(E, D, H, dtype=torch.bfloat16), torch.randn(E, H, D, dtype=torch.bfloat16)
    counts = torch.tensor([6, 0, 10, 8])
    with cuda_rules_autocast("2.11"):
        y = grouped_gemm_experts(gmm, x, w_in, w_out, counts)
    assert y.dtype == torch.bfloat16 and y.shape == (24, D)
