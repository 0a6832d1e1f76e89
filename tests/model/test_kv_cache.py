"""Incremental decoding: prefill + one-token steps (and chunked prefill) equal the full forward for MHA/GQA and
CCA/CCGQA under both residual streams; the offset attention mask; cache sizes and overflow."""
import pytest
import torch

from nagmoe.model.attention import AttentionCache, causal_attention
from tiny_models import tiny_model

V = 64
ATTENTIONS = {
    "mha": dict(kind="mha", n_kv_heads=None),
    "gqa": dict(kind="mha", n_kv_heads=2, rope_fraction=0.5),
    "cca": dict(kind="cca", q_compression=2, kv_compression=2),
    "ccgqa": dict(kind="cca", q_compression=1, kv_compression=4, conv_kernel_1=3, conv_kernel_2=3,
                  rope_fraction=0.5),
}


def _model(attention, residual, impl="sdpa", ffn="dense"):
    model = tiny_model(residual, impl, attention=dict(ATTENTIONS[attention]), ffn=ffn)
    with torch.no_grad():  # a real head (pre-norm's std-0.001 init would make every logit ~0)
        model.lm_head.weight.normal_(std=model.config.d_model ** -0.5)
        for block in model.blocks:  # and non-trivial temperatures
            if hasattr(block.attn, "log_temperature"):
                block.attn.log_temperature.uniform_(-0.5, 0.5)
    return model.eval()


def _idx(B=2, T=20, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _incremental(model, idx, chunks):
    """Feed idx in pieces of the given lengths (the rest one token at a time) through one cache."""
    cache = model.new_cache(idx.shape[1] + 3)
    outs, start = [], 0
    for n in [*chunks, *[1] * (idx.shape[1] - sum(chunks))]:
        assert cache.position == start
        outs.append(model(idx[:, start:start + n], cache=cache).logits)
        start += n
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_prefill_then_single_steps_equal_full_forward(attention, residual):
    model, idx = _model(attention, residual), _idx()
    with torch.no_grad():
        full = model(idx).logits
        step, cache = _incremental(model, idx, chunks=[7])
    assert full.abs().max() > 0.5  # the comparison is not between near-zero logits
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
    assert cache.position == idx.shape[1]


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_chunked_prefill_equals_full_forward(attention, impl):
    """Chunks longer than one token after the prefill use the offset causal mask; a first chunk shorter than
    the conv window exercises the zero conv history."""
    model, idx = _model(attention, "nag", impl), _idx(T=18)
    with torch.no_grad():
        full = model(idx).logits
        step, _ = _incremental(model, idx, chunks=[1, 4, 6, 2])
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_moe_model_decodes_like_its_full_forward():
    model, idx = _model("cca", "nag", ffn="moe"), _idx(T=12)
    with torch.no_grad():
        full = model(idx).logits
        step, _ = _incremental(model, idx, chunks=[5])
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_offset_attention_equals_rows_of_the_square_one(impl):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen),
               torch.randn(1, 2, 9, 8, generator=gen))
    square = causal_attention(q, k, v, impl)
    for offset in (5, 8):
        part = causal_attention(q[:, :, offset:], k, v, impl, q_offset=offset)
        torch.testing.assert_close(part, square[:, :, offset:], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="keys"):
        causal_attention(q[:, :, 5:], k, v, impl, q_offset=3)


def test_cache_sizes_and_overflow():
    mha, cca = _model("gqa", "nag"), _model("ccgqa", "nag")
    with torch.no_grad():
        for model in (mha, cca):
            cache = model.new_cache(6)
            model(_idx(T=4), cache=cache)
            model(_idx(T=2), cache=cache)
            with pytest.raises(ValueError, match="max_len"):
                model(_idx(T=1), cache=cache)
    L = mha.config.n_layers
    attn = mha.blocks[0].attn  # 2 kv heads of 8 dims, fp32: K and V
    assert mha.new_cache().max_len == mha.config.max_seq_len
    c = mha.new_cache(4)
    with torch.no_grad():
        mha(_idx(T=3), cache=c)
    assert c.kv_bytes_per_token() == L * 2 * attn.n_kv_heads * attn.head_dim * 4 and c.state_bytes() == 0
    a = cca.blocks[0].attn  # CCGQA: 1 kv head; conv history W = 2 + 2 tokens of C channels; shift K·S/2
    c = cca.new_cache(4)
    with torch.no_grad():
        cca(_idx(T=3), cache=c)
    assert c.kv_bytes_per_token() == L * 2 * a.n_kv_heads * a.head_dim * 4
    assert a.conv_history == 4
    assert c.state_bytes() == L * 4 * (a.channels * 4 + a.n_kv_heads * a.head_dim // 2)


def test_attention_cache_rejects_nonsense():
    with pytest.raises(ValueError):
        AttentionCache(0)
