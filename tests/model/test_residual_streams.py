"""Residual streams: NAG encode/decode parametrisations, gate init, pre-norm decode, and the statistics."""
import math

import pytest
import torch
import torch.nn.functional as F

from nagmoe.model.residual import NAGResidual, NAGState, PreNormResidual
from nagmoe.model.stats import mean_angle
from tiny_models import tiny_config, tiny_model

V, D = 64, 32


def _random_table(rows, seed, offset=3.0):
    """Random, deliberately non-centred and non-normalised rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, D, generator=gen) * torch.rand(rows, 1, generator=gen) * 4 + offset


def test_nag_decode_is_norm_times_cosine():
    stream = NAGResidual(tiny_config("nag"), n_sublayers=4)
    lm_head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(_random_table(V, seed=0))
    gen = torch.Generator().manual_seed(1)
    log_norm = torch.randn(2, 5, generator=gen)
    direction = torch.randn(2, 5, D, generator=gen)
    direction = (direction - direction.mean(-1, keepdim=True))
    direction = direction / direction.pow(2).mean(-1, keepdim=True).sqrt()
    logits = stream.decode(NAGState(log_norm, direction), lm_head)
    # independent: centred unembedding rows, cosine similarity, times exp(s)
    w = lm_head.weight - lm_head.weight.mean(-1, keepdim=True)
    cos = F.cosine_similarity(direction[:, :, None, :], w[None, None], dim=-1)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, log_norm.exp()[..., None] * cos, atol=1e-5, rtol=1e-5)


def test_nag_encode_centres_but_does_not_normalise_the_embedding():
    stream = NAGResidual(tiny_config("nag"), n_sublayers=4)
    with torch.no_grad():
        stream.g_encode.fill_(0.3)
    wte = torch.nn.Embedding(V, D)
    with torch.no_grad():
        wte.weight.copy_(_random_table(V, seed=2))
    idx = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))
    log_norm, direction = stream.encode(wte, idx)
    e = wte.weight[idx] - wte.weight[idx].mean(-1, keepdim=True)
    rms = e.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(log_norm, rms.log() + 0.3)
    torch.testing.assert_close(direction, e / rms[..., None], atol=1e-5, rtol=1e-5)
    assert log_norm.dtype == torch.float32


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_embedding_parametrisation_holds_for_arbitrary_weights(residual):
    """NAG: shifting an embedding row by a constant changes nothing (centred in the forward); scaling the
    whole table by c multiplies every logit by c (only the norm lane sees the scale: norm-agnostic).
    Unembedding rows: shifting or rescaling them changes nothing (centred and normalised in the forward)."""
    model = tiny_model(residual)
    model.eval()
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        base = model(idx).logits
        model.wte.weight.add_(torch.randn(V, 1, generator=gen) * 3)  # per-row constant shifts
        shifted = model(idx).logits
        model.wte.weight.mul_(2.5)
        scaled = model(idx).logits
        model.lm_head.weight.mul_(torch.rand(V, 1, generator=gen) * 5 + 0.1)
        model.lm_head.weight.add_(torch.randn(V, 1, generator=gen))
        head_changed = model(idx).logits
    if residual == "nag":
        torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(scaled, 2.5 * shifted, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head_changed, scaled, atol=1e-4, rtol=1e-4)
    else:  # the pre-norm baseline has neither constraint: the same edits do change it
        assert not torch.allclose(shifted, base, atol=1e-3)
        assert not torch.allclose(head_changed, scaled, atol=1e-3)


def test_nag_gate_init():
    cfg = tiny_config("nag")
    cfg.nag.beta_init = 0.7
    stream = NAGResidual(cfg, n_sublayers=4)
    for index, gate in enumerate(stream.gates):
        assert gate.weight.shape == (cfg.nag.C, D)
        assert gate.alpha.item() == pytest.approx((index + 1) ** -0.5)  # block i: attn 2i+1, FFN 2i+2
        assert gate.beta().item() == pytest.approx(0.7)
        assert gate.bias.abs().sum() == 0 and gate.coef.abs().sum() == 0
    assert stream.g_encode.item() == 0 and stream.g_encode.dtype == torch.float32
    weights = torch.cat([g.weight.flatten() for g in stream.gates])
    assert weights.std().item() == pytest.approx(D ** -0.5, rel=0.15)


def test_prenorm_decode_applies_the_softcap():
    cfg = tiny_config("prenorm")
    cfg.logit_softcap = 2.0
    stream = PreNormResidual(cfg, n_sublayers=4)
    lm_head = torch.nn.Linear(D, V, bias=False)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(0)) * 7
    logits = stream.decode(x, lm_head)
    raw = lm_head(x / x.pow(2).mean(-1, keepdim=True).add(torch.finfo(x.dtype).eps).sqrt())
    torch.testing.assert_close(logits, 2.0 * torch.tanh(raw / 2.0), atol=1e-5, rtol=1e-5)
    assert logits.abs().max() < 2.0


# ----------------------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------------------
NAG_KEYS = {"log_norm_in", "log_norm_out", "rotation_angle", "alpha", "beta", "m_mean", "m_min",
            "m_floor_frac", "gain_mean"}
PRENORM_KEYS = {"log_norm_in", "log_norm_out", "rotation_angle", "stream_rms_in", "stream_rms_out"}


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_stats_do_not_change_outputs_and_have_the_keys(residual):
    model = tiny_model(residual)
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    off = model(idx)
    assert off.stats is None
    on = model(idx, collect_stats=True)
    torch.testing.assert_close(on.logits, off.logits, atol=0, rtol=0)
    model.collect_stats = True
    on_attr = model(idx, targets_BT=idx)
    assert on_attr.stats is not None
    keys = NAG_KEYS if residual == "nag" else PRENORM_KEYS
    assert keys <= set(on.stats)
    n_sublayers = 2 * model.config.n_layers
    for key in keys:
        assert len(on.stats[key]) == n_sublayers and all(isinstance(v, float) for v in on.stats[key])
        assert all(math.isfinite(v) for v in on.stats[key])
    # consecutive sublayers chain: what leaves sublayer k enters sublayer k + 1
    assert on.stats["log_norm_out"][:-1] == pytest.approx(on.stats["log_norm_in"][1:], abs=1e-5)
    assert all(a > 0 for a in on.stats["rotation_angle"])  # every (randomised) sublayer moved the stream


def test_nag_stats_values():
    model = tiny_model("nag")
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))
    stats = model(idx, collect_stats=True).stats
    assert stats["alpha"] == pytest.approx([(k + 1) ** -0.5 for k in range(4)], rel=1e-6)
    for k in range(4):
        # realised gain = alpha * m (warm-up 1); the norm never shrinks; rotation at most arctan(alpha)
        assert stats["gain_mean"][k] == pytest.approx(stats["alpha"][k] * stats["m_mean"][k], rel=1e-5)
        assert stats["log_norm_out"][k] > stats["log_norm_in"][k]
        assert 0 < stats["rotation_angle"][k] <= math.atan(stats["alpha"][k]) + 1e-6
        assert 0 < stats["m_min"][k] <= stats["m_mean"][k] <= 1 and stats["m_floor_frac"][k] == 0
    assert stats["g_encode"] == 0.0 and stats["injection_warmup"] == 1.0
    model.set_injection_warmup(0.0)
    stats = model(idx, collect_stats=True).stats
    assert stats["gain_mean"] == [0.0] * 4 and max(stats["rotation_angle"]) < 1e-3


def test_mean_angle_is_accurate_near_zero():
    a = torch.tensor([[1.0, 0.0]])
    for theta in (1e-6, 1e-3, 1.0, 3.0):
        b = torch.tensor([[math.cos(theta), math.sin(theta)]]) * 5
        assert mean_angle(a, b).item() == pytest.approx(theta, rel=1e-4)
