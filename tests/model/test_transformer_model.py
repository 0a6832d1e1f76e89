"""The whole model: output contract, causality, learning, parameter roles, warm-up, autocast lanes."""
import math
from collections import Counter

import pytest
import torch

from nagmoe.model import ModelOutput, Transformer, build_model
from nagmoe.model.roles import EMBEDDING, GATE, MATRIX, SCALAR, UNEMBEDDING, param_roles
from tiny_models import tiny_config, tiny_model

V = 64
RESIDUALS = ["nag", "prenorm"]


def _idx(B=2, T=12, seed=0, high=V):
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("residual", RESIDUALS)
def test_output_contract(residual):
    model = tiny_model(residual)
    idx, targets = _idx(), _idx(seed=1)
    out = model(idx)
    assert isinstance(out, ModelOutput) and isinstance(model, Transformer)
    assert out.logits.shape == (2, 12, V) and out.logits.dtype == torch.float32
    assert out.loss is None and out.stats is None
    assert out.aux_loss.dim() == 0 and out.aux_loss.item() == 0.0
    trained = model(idx, targets)
    assert trained.logits is None and trained.loss.dim() == 0
    per_token = model(idx, targets, reduction="none").loss
    assert per_token.shape == (2, 12) and per_token.dtype == torch.float32
    torch.testing.assert_close(per_token.mean(), trained.loss)
    expected = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(trained.loss, expected)
    ignored = targets.clone()
    ignored[:, :4] = -1  # targets < 0 are not scored
    torch.testing.assert_close(model(idx, ignored).loss, per_token[:, 4:].mean())


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_model_is_causal(residual, impl):
    model = tiny_model(residual, impl)
    idx = _idx(T=16)
    t = 7
    changed = idx.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 1 + _idx(T=16 - t - 1, seed=3, high=V - 1)) % V
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


@pytest.mark.parametrize("residual", RESIDUALS)
def test_math_and_sdpa_models_agree(residual):
    sdpa, math_ = tiny_model(residual, "sdpa"), tiny_model(residual, "math")
    math_.load_state_dict(sdpa.state_dict())
    idx = _idx(T=16)
    with torch.no_grad():
        torch.testing.assert_close(math_(idx).logits, sdpa(idx).logits, atol=1e-5, rtol=1e-5)


def _bigram_conditional_entropy(x, y):
    pairs, current = Counter(zip(x.flatten().tolist(), y.flatten().tolist())), Counter(x.flatten().tolist())
    return -sum(c * math.log(c / current[a]) for (a, _), c in pairs.items()) / x.numel()


@pytest.mark.parametrize("residual", RESIDUALS)
def test_model_overfits_a_fixed_batch(residual):
    """From the real init (zero output projections). Tokens come from 8 symbols so that the best model
    using only the current token (the bigram conditional entropy, ~1.6 nats here) is far from 0: going well
    below it needs the attention and FFN sublayers to work."""
    torch.manual_seed(0)
    model = build_model(tiny_config(residual))
    data = _idx(B=4, T=17, seed=1, high=8)
    x, y = data[:, :-1], data[:, 1:]
    bigram = _bigram_conditional_entropy(x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(100):
        loss = model(x, y).loss
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    final = model(x, y).loss.item()
    assert first == pytest.approx(math.log(V), abs=0.3)
    assert final < 0.5 * first
    assert final < 0.5 * bigram


def test_param_roles_cover_every_parameter():
    for residual in RESIDUALS:
        model = tiny_model(residual)
        roles = param_roles(model)
        assert set(roles) == {name for name, _ in model.named_parameters()}
        assert roles["wte.weight"] == EMBEDDING and roles["lm_head.weight"] == UNEMBEDDING
        assert roles["blocks.0.attn.c_q.weight"] == MATRIX and roles["blocks.1.ffn.c_proj.weight"] == MATRIX
        gates = {name: role for name, role in roles.items() if ".gates." in name}
        if residual == "nag":
            assert roles["stream.g_encode"] == SCALAR
            assert len(gates) == 2 * 2 * 5 and set(gates.values()) == {GATE}
        else:
            assert not gates


def test_injection_warmup_zero_turns_every_sublayer_off():
    """With factor 0 the NAG model is encode -> decode: the sublayer weights do not matter."""
    a, b = tiny_model("nag", seed=0), tiny_model("nag", seed=1)
    with torch.no_grad():
        b.wte.weight.copy_(a.wte.weight)
        b.lm_head.weight.copy_(a.lm_head.weight)
    idx = _idx()
    with torch.no_grad():
        assert not torch.allclose(a(idx).logits, b(idx).logits)
        for m in (a, b):
            m.set_injection_warmup(0.0)
        torch.testing.assert_close(a(idx).logits, b(idx).logits, atol=1e-6, rtol=1e-6)
        half = a.stream.injection_warmup.clone()
    assert half.item() == 0.0 and "stream.injection_warmup" not in a.state_dict()
    with pytest.raises(ValueError):
        a.set_injection_warmup(1.5)
    tiny_model("prenorm").set_injection_warmup(0.5)  # a no-op for the baseline


@pytest.mark.parametrize("precision,direction", [("uniform", torch.float32), ("legacy", torch.bfloat16)])
def test_nag_lanes_under_bf16_autocast(precision, direction):
    model = tiny_model("nag")
    model.set_precision(precision)  # train.precision: the direction lane fp32, or bf16 in legacy run dirs
    idx = _idx()
    seen = {}
    orig_apply = model.stream.apply

    def spy(index, sublayer, state, stats=None):
        seen[index] = (state.log_norm_BT.dtype, state.direction_BTD.dtype)
        return orig_apply(index, sublayer, state, stats)

    model.stream.apply = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, _idx(seed=1))
        logits = model(idx).logits
    assert set(seen.values()) == {(torch.float32, direction)}
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        reference = model(idx).logits
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def test_moe_ffn_is_wired_in():
    pytest.importorskip("nagmoe.model.moe")
    for residual in RESIDUALS:
        torch.manual_seed(0)
        cfg = tiny_config(residual, ffn="moe")
        cfg.moe.n_experts, cfg.moe.top_k = 4, 2
        model = build_model(cfg)
        out = model(_idx(), _idx(seed=1))
        assert out.aux_loss.dim() == 0 and out.aux_loss.item() > 0
        (out.loss + out.aux_loss).backward()
        roles = param_roles(model)
        assert set(roles) == {name for name, _ in model.named_parameters()}
