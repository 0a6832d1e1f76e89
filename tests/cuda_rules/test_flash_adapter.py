"""The flash-attn adapter casts and checks q, k and v together (issue 38). Under CUDA's autocast from torch 2.12
`rms_norm` is fp32, so CCA's / QK-norm's q and k arrive fp32 while v is bf16; the adapter looked at q only, so
such a call fell back to SDPA (and a bf16 q with an fp32 k would reach flash-attn mixed). flash-attn does not
install on a CPU machine: a stand-in module with its call signature checks what reaches it."""
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from nagmoe.cuda_rules.tier import cuda_rules_autocast
from nagmoe.model.attention import causal_attention


@pytest.fixture
def flash_calls(monkeypatch):
    calls = []

    def flash_attn_func(q, k, v, causal):  # (B, T, H, S) layout, as flash-attn's
        assert causal
        calls.append((q.dtype, k.dtype, v.dtype))
        assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=flash_attn_func))
    return calls


def _qkv(*dtypes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 16, generator=g).to(d) for d in dtypes]


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32, torch.bfloat16)])
def test_flash_gets_one_low_precision_dtype_under_cuda_rules(flash_calls, dtypes):
    q, k, v = _qkv(*dtypes)
    with cuda_rules_autocast("2.13"):
        out = causal_attention(q, k, v, "flash")
    assert flash_calls == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    ref = causal_attention(q.float(), k.float(), v.float(), "math")
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_mixed_inputs_without_autocast_go_low_together_and_fp32_takes_sdpa(flash_calls):
    causal_attention(*_qkv(torch.float32, torch.float32, torch.bfloat16), "flash")
    assert flash_calls == [(torch.bfloat16,) * 3]
    out = causal_attention(*_qkv(torch.float32, torch.float32, torch.float32), "flash")
    assert len(flash_calls) == 1 and out.dtype == torch.float32  # fp32 outside autocast: SDPA
