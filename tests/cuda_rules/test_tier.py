"""The CUDA-rules tier (issue 38): CUDA's casts where CUDA's dispatcher makes them, and nothing left behind."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from nagmoe.cuda_rules.tier import CudaAutocastRules, cuda_rules_autocast, rules_from_env
from nagmoe.base.errors import UserError


def _relu2(x, w):
    return F.relu(x @ w).square()


def _registrations():
    return sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))


def test_composites_and_keywords_meet_cudas_rules():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU's own rules, for contrast
        assert _relu2(x, w).dtype == torch.bfloat16 and (x @ w).sum(dim=0).dtype == torch.bfloat16
    with cuda_rules_autocast("2.11"):
        h = x @ w
        assert h.dtype == torch.bfloat16
        assert _relu2(x, w).dtype == torch.float32                     # square -> pow: fp32 on CUDA
        assert h.sum(dim=0).dtype == torch.float32                     # sum: fp32 unless a dtype is given
        assert h.sum(dim=0, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert h.softmax(-1).dtype == torch.float32
        assert F.cross_entropy(h, torch.arange(4)).dtype == torch.float32  # -> log_softmax + nll_loss
        assert torch.norm(h).dtype == torch.float32                   # fp32 with appended dtype
        assert torch.addcmul(h, h, x).dtype == torch.float32          # promote: fp32 wins
        assert torch.stack([h, h]).dtype == torch.bfloat16            # CPU-only cast switched off
        assert torch.rms_norm(h, (8,)).dtype == torch.bfloat16        # 2.11: not on a list
        with pytest.raises(RuntimeError, match="banned"):
            F.binary_cross_entropy(torch.sigmoid(h.float()), torch.rand(4, 8))
    with cuda_rules_autocast("2.13"):
        assert torch.rms_norm(x @ w, (8,)).dtype == torch.float32      # >= 2.12: fp32


def test_the_tier_leaves_nothing_registered_even_after_an_error():
    before = _registrations()
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        with cuda_rules_autocast("2.13"):
            assert x.square().dtype == torch.float32
            raise ValueError("boom")
    assert _registrations() == before
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x.T).square().dtype == torch.bfloat16 and torch.stack([x.bfloat16(), x]).dtype == torch.float32
    rules = CudaAutocastRules("2.11")
    with rules, pytest.raises(RuntimeError, match="already active"):
        rules.__enter__()
    assert _registrations() == before


def test_activation_checkpoint_recompute_sees_the_rules():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    seen = []

    def body(x, w):
        y = _relu2(x, w)
        seen.append(y.dtype)
        return y

    with CudaAutocastRules("2.11"):
        with torch.autocast("cpu", dtype=torch.bfloat16), set_checkpoint_early_stop(False):  # whole recompute
            out = checkpoint(body, x, w, use_reentrant=False)
        out.sum().backward()  # the recompute runs here, outside the autocast block, under its saved state
    assert seen == [torch.float32, torch.float32] and w.grad is not None


def test_compiled_code_sees_the_rules():
    torch._dynamo.reset()
    f = torch.compile(_relu2, backend="aot_eager", fullgraph=True)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8)
    with cuda_rules_autocast("2.11"):
        assert f(x, w).dtype == torch.float32
    torch._dynamo.reset()


def test_env_switch_names_a_known_version():
    assert rules_from_env({}) is None and rules_from_env({"NAGMOE_CUDA_RULES": "2.11"}) == "2.11"
    with pytest.raises(UserError, match="NAGMOE_CUDA_RULES"):
        rules_from_env({"NAGMOE_CUDA_RULES": "9.9"})
