"""MHA/GQA attention: the `math` reference equals `sdpa`, causality, RoPE's relative-position property,
GQA head grouping, and the registries' user-facing errors."""
import importlib.util

import pytest
import torch

from nagmoe.config import AttentionConfig
from nagmoe.base.errors import UserError
from nagmoe.model.attention import (
    MultiHeadAttention, apply_rope, build_attention, resolve_attention_impl, rope_tables, rotary_dims)

D = 32


def _attention(impl="sdpa", seed=0, **cfg):
    torch.manual_seed(seed)
    attn = MultiHeadAttention(D, AttentionConfig(impl=impl, **cfg))
    with torch.no_grad():  # zero-init c_proj would make every comparison trivial
        attn.c_proj.weight.normal_(std=D ** -0.5)
    return attn


def _x(B=2, T=12, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


CASES = [
    dict(n_heads=4),  # MHA
    dict(n_heads=4, n_kv_heads=2),  # GQA
    dict(n_heads=4, n_kv_heads=1, rope_fraction=0.5, qk_norm=False),  # MQA, partial RoPE, no QK-norm
    dict(n_heads=2, head_dim=8, rope_fraction=0.0),  # explicit head dim, no RoPE
]


@pytest.mark.parametrize("cfg", CASES)
def test_math_equals_sdpa(cfg):
    sdpa, math_ = _attention("sdpa", **cfg), _attention("math", **cfg)
    math_.load_state_dict(sdpa.state_dict())
    assert (sdpa.impl, math_.impl) == ("sdpa", "math")
    x = _x()
    torch.testing.assert_close(math_(x)[0], sdpa(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_attention_is_causal(impl):
    attn = _attention(impl, n_heads=4, n_kv_heads=2)
    x = _x()
    t = 6
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn(x2[:, t + 1:].shape, generator=torch.Generator().manual_seed(9))
    y, y2 = attn(x)[0], attn(x2)[0]
    torch.testing.assert_close(y[:, : t + 1], y2[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])


def test_rope_scores_depend_on_relative_position_only():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)
    rot = rotary_dims(16, 1.0)

    def score(pos_q, pos_k):
        cq, sq = rope_tables(1, rot, 10000.0, "cpu", offset=pos_q)
        ck, sk = rope_tables(1, rot, 10000.0, "cpu", offset=pos_k)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(score(7, 3), score(3, 3))
    # rotation preserves the norm; dims beyond the rotary part pass through unchanged
    c, s = rope_tables(5, rotary_dims(16, 0.5), 10000.0, "cpu")
    x = torch.randn(1, 5, 2, 16, generator=gen)
    y = apply_rope(x, c, s)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 8:], x[..., 8:], atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_gqa_equals_mha_with_shared_kv_heads(impl):
    """Query head h uses key/value head h // (H/K): a GQA module equals an MHA module whose K/V projections
    repeat each key/value head H/K times."""
    gqa = _attention(impl, n_heads=4, n_kv_heads=2)
    mha = _attention(impl, n_heads=4)
    hd = D // 4
    with torch.no_grad():
        for name in ("c_q", "c_proj"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("c_k", "c_v"):
            w = getattr(gqa, name).weight.view(2, hd, D)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(4 * hd, D))
    x = _x()
    torch.testing.assert_close(gqa(x)[0], mha(x)[0], atol=1e-5, rtol=1e-5)


def test_output_projection_zero_init_and_call_shape():
    torch.manual_seed(0)
    attn = MultiHeadAttention(D, AttentionConfig(n_heads=4))
    assert attn.c_proj.weight.abs().sum() == 0
    assert all(lin.bias is None for lin in (attn.c_q, attn.c_k, attn.c_v, attn.c_proj))
    y, aux = attn(_x())
    assert y.shape == (2, 12, D) and aux is None


def test_impl_and_kind_errors_are_user_errors():
    assert resolve_attention_impl("auto") == "sdpa"
    with pytest.raises(UserError, match="model.attention.impl"):
        resolve_attention_impl("nope")
    if not torch.cuda.is_available():  # flash-attn is CUDA-only: asked for here, SDPA runs, with a warning
        with pytest.warns(UserWarning, match="'flash' is not available here; using 'sdpa'"):
            assert resolve_attention_impl("flash") == "sdpa"
    if importlib.util.find_spec("nagmoe.model.cca") is None:
        with pytest.raises(UserError, match="model.attention.kind"):
            build_attention(D, AttentionConfig(kind="cca"))
    with pytest.raises(UserError, match="model.attention.kind"):
        build_attention(D, AttentionConfig(kind="nope"))
