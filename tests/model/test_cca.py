"""CCA / CCGQA: reduces to plain latent multi-head attention with its extras off, causality (module and
model, both residuals), the q-k mean formula on hand-sized tensors, the value shift, the temperature, Table II
parameter counts, optimizer roles and user errors."""
import math

import pytest
import torch

from nagmoe.config import AttentionConfig
from nagmoe.base.errors import UserError
from nagmoe.model.attention import AttentionCache, MultiHeadAttention, build_attention
from nagmoe.model.cca import CCAttention, qk_mean
from nagmoe.model.roles import CONV, MATRIX, SCALAR, param_roles
from tiny_models import tiny_model

D = 32
CCA = dict(kind="cca", n_heads=4, q_compression=2, kv_compression=2)  # 2 query = 2 kv heads of 8
CCGQA = dict(kind="cca", n_heads=8, head_dim=8, q_compression=2, kv_compression=4)  # 4 query, 2 kv heads
OFF = dict(use_convs=False, use_qk_mean=False, use_value_shift=False)


def _cca(seed=0, **cfg):
    torch.manual_seed(seed)
    attn = CCAttention(D, AttentionConfig(**cfg))
    with torch.no_grad():  # zero-init c_proj would make every comparison trivial
        attn.c_proj.weight.normal_(std=D ** -0.5)
    return attn


def _x(B=2, T=12, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("geometry", [dict(CCA, rope_fraction=0.5), CCGQA], ids=["cca", "ccgqa"])
def test_equals_plain_latent_attention_with_extras_off(geometry, impl):
    """Convs, q-k mean and value shift off: c_q/c_k/c_v into H and K latent heads, L2 QK-norm (temperature 1
    at init), RoPE, SDPA, c_proj — exactly MultiHeadAttention with those head counts and the same weights."""
    cca = _cca(impl=impl, **geometry, **OFF)
    plain = MultiHeadAttention(D, AttentionConfig(n_heads=cca.n_heads, n_kv_heads=cca.n_kv_heads,
                                                  head_dim=cca.head_dim, impl=impl,
                                                  rope_fraction=geometry.get("rope_fraction", 1.0)))
    plain.load_state_dict({k: v for k, v in cca.state_dict().items() if k != "log_temperature"})
    assert not hasattr(cca, "conv_seq") and cca.shifted == 0
    x = _x()
    torch.testing.assert_close(cca(x)[0], plain(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("geometry", [CCA, CCGQA], ids=["cca", "ccgqa"])
def test_module_is_causal_with_convs_mean_and_shift(geometry, impl):
    attn = _cca(impl=impl, conv_kernel_1=3, conv_kernel_2=2, **geometry)
    x = _x(T=16)
    t = 6
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn(x2[:, t + 1:].shape, generator=torch.Generator().manual_seed(9))
    y, y2 = attn(x)[0], attn(x2)[0]
    torch.testing.assert_close(y[:, : t + 1], y2[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
@pytest.mark.parametrize("kind", ["mha", "cca"])
def test_model_is_causal_both_kinds_both_residuals(kind, residual):
    attention = dict(kind=kind, q_compression=2, kv_compression=4, conv_kernel_1=3)  # CCGQA for cca
    model = tiny_model(residual, attention=attention)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    t = 7
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 64
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_math_equals_sdpa():
    sdpa, math_ = _cca(impl="sdpa", **CCGQA), _cca(impl="math", **CCGQA)
    math_.load_state_dict(sdpa.state_dict())
    x = _x()
    torch.testing.assert_close(math_(x)[0], sdpa(x)[0], atol=1e-5, rtol=1e-5)


def test_qk_mean_follows_the_formula_on_hand_sized_tensors():
    """H = 4 query heads, K = 2 kv heads (G = 2), head dim 1, one token:
    mean_q[h] = (q0[h] + k0[h // 2]) / 2;  mean_k[j] = mean of mean_q over the query heads of group j."""
    q0 = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 4, 1)
    k0 = torch.tensor([10.0, 20.0]).view(1, 1, 2, 1)
    mean_q, mean_k = qk_mean(q0, k0)
    assert mean_q.flatten().tolist() == [5.5, 6.0, 11.5, 12.0]
    assert mean_k.flatten().tolist() == [5.75, 11.75]
    # plain CCA (G = 1): both are (q0 + k0) / 2
    mean_q, mean_k = qk_mean(q0[:, :, :2], k0)
    assert mean_q.flatten().tolist() == mean_k.flatten().tolist() == [5.5, 11.0]


def test_latents_add_the_pre_conv_mean_to_the_conv_output():
    attn = _cca(**CCGQA)
    x = _x(T=5)
    q, k, _ = attn.latents(x)
    B, T, H, K, S = 2, 5, attn.n_heads, attn.n_kv_heads, attn.head_dim
    q0, k0 = attn.c_q(x), attn.c_k(x)
    qk = torch.nn.functional.pad(torch.cat([q0, k0], -1).transpose(1, 2), (attn.conv_history, 0))
    conv = attn.conv_head(attn.conv_seq(qk)).transpose(1, 2)
    mean_q, mean_k = qk_mean(q0.view(B, T, H, S), k0.view(B, T, K, S))
    torch.testing.assert_close(q, conv[..., : H * S].view(B, T, H, S) + mean_q)
    torch.testing.assert_close(k, conv[..., H * S:].view(B, T, K, S) + mean_k)


def test_value_shift_takes_the_last_half_from_the_previous_token():
    attn = _cca(**CCA)
    x = _x(T=6)
    _, _, v = attn.latents(x)
    v_BTJ, proj = v.flatten(2), attn.c_v(x)
    half = proj.shape[-1] // 2
    torch.testing.assert_close(v_BTJ[..., :half], proj[..., :half], atol=0, rtol=0)
    torch.testing.assert_close(v_BTJ[:, 1:, half:], proj[:, :-1, half:], atol=0, rtol=0)
    assert v_BTJ[:, 0, half:].abs().sum() == 0  # x_{-1} = 0


def test_temperature_scales_the_normalised_keys_per_kv_head():
    attn = _cca(**CCGQA, rope_fraction=0.0)
    assert attn.log_temperature.shape == (attn.n_kv_heads,) and attn.log_temperature.abs().sum() == 0
    with torch.no_grad():
        attn.log_temperature.copy_(torch.tensor([0.0, math.log(3.0)]))
        cache = AttentionCache(8)
        attn(_x(T=4), cache=cache)
    norms = cache.k_BKLS[:, :, :4].norm(dim=-1)  # (B, K, T): sqrt(S) * exp(T_j)
    S = attn.head_dim
    torch.testing.assert_close(norms[:, 0], torch.full_like(norms[:, 0], math.sqrt(S)))
    torch.testing.assert_close(norms[:, 1], torch.full_like(norms[:, 1], 3 * math.sqrt(S)))


def test_every_parameter_gets_a_gradient():
    attn = _cca(**CCGQA)
    attn(_x())[0].square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("c1, c2", [(4, 4), (2, 2), (2, 8), (1, 4)])
def test_parameter_count_is_table_ii(c1, c2):
    """E = n_heads * head_dim: attention 2E²/C1 + 2E²/C2 (CCA: 4E²/C), conv ē·k1 + ē²/(n_q+n_kv)·k2 and
    the two biases (2ē), with ē = (n_q + n_kv)·d_h; plus one temperature per kv head."""
    E, n_ref, k1, k2 = 64, 8, 3, 2
    attn = CCAttention(E, AttentionConfig(kind="cca", n_heads=n_ref, q_compression=c1, kv_compression=c2,
                                          conv_kernel_1=k1, conv_kernel_2=k2))
    n_q, n_kv, d_h = n_ref // c1, n_ref // c2, E // n_ref
    e_bar = (n_q + n_kv) * d_h
    table_ii = 2 * E * E // c1 + 2 * E * E // c2 + e_bar * k1 + e_bar * e_bar // (n_q + n_kv) * k2 + 2 * e_bar
    assert sum(p.numel() for p in attn.parameters()) == table_ii + n_kv


def test_roles_conv_is_adamw_temperature_scalar():
    from nagmoe.config import TrainConfig
    from nagmoe.train.optim import build_optimizers

    model = tiny_model("nag", attention=dict(CCGQA), ffn="moe")
    roles = param_roles(model)
    for name in ("conv_seq.weight", "conv_seq.bias", "conv_head.weight", "conv_head.bias"):
        assert roles[f"blocks.0.attn.{name}"] == CONV
    assert roles["blocks.0.attn.log_temperature"] == SCALAR
    for name in ("c_q", "c_k", "c_v", "c_proj"):
        assert roles[f"blocks.1.attn.{name}.weight"] == MATRIX
    muon = build_optimizers(model, TrainConfig()).muon_param_names()
    assert not any("conv" in n or "temperature" in n for n in muon)
    assert "blocks.0.attn.c_q.weight" in muon and "blocks.0.ffn.w_in" in muon


def test_init_zero_output_and_registry():
    torch.manual_seed(0)
    attn = build_attention(D, AttentionConfig(**CCA))
    assert isinstance(attn, CCAttention)
    assert attn.c_proj.weight.abs().sum() == 0
    assert all(lin.bias is None for lin in (attn.c_q, attn.c_k, attn.c_v, attn.c_proj))
    y, aux = attn(_x())
    assert y.shape == (2, 12, D) and aux is None and y.abs().sum() == 0


@pytest.mark.parametrize("cfg, key", [
    (dict(n_heads=4, q_compression=3), "model.attention.q_compression"),
    (dict(n_heads=4, q_compression=1, kv_compression=8), "model.attention.kv_compression"),
    (dict(n_heads=8, q_compression=4, kv_compression=2), "model.attention.kv_compression"),  # K > H
    (dict(n_heads=12, q_compression=4, kv_compression=6), "model.attention.kv_compression"),  # 3 % 2
])
def test_bad_compression_is_a_user_error(cfg, key):
    with pytest.raises(UserError, match=key):
        CCAttention(D if cfg["n_heads"] != 12 else 48, AttentionConfig(kind="cca", **cfg))
