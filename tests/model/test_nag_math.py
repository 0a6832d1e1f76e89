"""Invariants of the pure NAG math (nagmoe/model/nag.py): geometry of the update, modulator range and
gradients, rotation-score limits."""
import math

import pytest
import torch
import torch.nn.functional as F

from nagmoe.model.nag import branch_direction, modulator, nag_update, rms_normalise, rotation_score

D = 48


def _lanes(shape=(3, 5), d=D, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    direction = rms_normalise(direction - direction.mean(-1, keepdim=True)).to(dtype)  # centred, as in the stream
    log_norm = torch.randn(*shape, generator=gen, dtype=torch.float64).float()
    branch = (torch.randn(*shape, d, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)  # not centred
    scale = torch.linspace(-3.0, 5.0, math.prod(shape), dtype=torch.float64).view(shape).float()
    return log_norm, direction, branch, scale


def test_direction_stays_rms_one_fp32():
    log_norm, direction, branch, scale = _lanes()
    _, new_direction = nag_update(log_norm, direction, branch, scale)
    rms = new_direction.pow(2).mean(-1).sqrt()
    assert new_direction.dtype == torch.float32
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-5, rtol=0)


def test_update_is_orthogonal_to_the_input_direction():
    log_norm, direction, branch, scale = _lanes(dtype=torch.float64)
    u = branch_direction(direction, branch)
    # u is centred, orthogonal to the direction, and has RMS 1
    torch.testing.assert_close(u.mean(-1), torch.zeros(u.shape[:-1], dtype=u.dtype), atol=1e-12, rtol=0)
    torch.testing.assert_close((u * direction).sum(-1), torch.zeros(u.shape[:-1], dtype=u.dtype),
                               atol=1e-10, rtol=0)
    # RMS 1 up to the eps inside N_out (relative ~eps / ||f_perp||^2)
    torch.testing.assert_close(u.pow(2).mean(-1), torch.ones(u.shape[:-1], dtype=u.dtype), atol=1e-7, rtol=0)
    # the change of the (unnormalised) direction is g·u, so it is orthogonal to the input too
    _, new_direction = nag_update(log_norm, direction, branch, scale)
    g = scale.double().unsqueeze(-1)
    change = new_direction * torch.sqrt(1 + g ** 2) - direction
    torch.testing.assert_close((change * direction).sum(-1), torch.zeros_like(scale, dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(change, g * u, atol=1e-6, rtol=0)


def test_log_norm_gain_and_rotation_angle():
    log_norm, direction, branch, scale = _lanes(dtype=torch.float64)
    new_log_norm, new_direction = nag_update(log_norm, direction, branch, scale)
    g = scale.double()
    torch.testing.assert_close(new_log_norm - log_norm.double(), 0.5 * torch.log1p(g ** 2), atol=1e-7, rtol=0)
    angle = torch.acos(F.cosine_similarity(direction, new_direction, dim=-1).clamp(-1, 1))
    torch.testing.assert_close(angle, torch.atan(g.abs()), atol=1e-6, rtol=0)


def test_scalar_scale_and_lane_dtypes():
    log_norm, direction, branch, _ = _lanes()
    new_log_norm, new_direction = nag_update(log_norm, direction.bfloat16(), branch.bfloat16(), 0.7)
    assert new_direction.dtype == torch.bfloat16 and new_log_norm.dtype == torch.float32
    torch.testing.assert_close(new_log_norm - log_norm, torch.full_like(log_norm, 0.5 * math.log1p(0.49)),
                               atol=1e-6, rtol=0)


def test_zero_branch_output_is_harmless_and_has_finite_gradient():
    log_norm, direction, _, scale = _lanes()
    branch = torch.zeros_like(direction, requires_grad=True)
    new_log_norm, new_direction = nag_update(log_norm, direction, branch, scale)
    assert torch.isfinite(new_log_norm).all() and torch.isfinite(new_direction).all()
    torch.testing.assert_close(new_log_norm, log_norm, atol=0, rtol=0)  # no norm gain
    torch.testing.assert_close(new_direction, direction, atol=1e-6, rtol=0)  # no rotation
    probe = torch.randn(new_direction.shape, generator=torch.Generator().manual_seed(3))
    ((new_direction * probe).sum() + new_log_norm.sum()).backward()
    assert torch.isfinite(branch.grad).all()
    assert branch.grad.abs().sum() > 0  # gradient reaches a zero-initialised output projection


def test_branch_parallel_to_direction_gives_no_update():
    log_norm, direction, _, scale = _lanes(dtype=torch.float64)
    new_log_norm, new_direction = nag_update(log_norm, direction, 4.0 * direction + 2.0, scale)
    torch.testing.assert_close(new_direction, direction, atol=1e-6, rtol=0)
    torch.testing.assert_close(new_log_norm, log_norm.double(), atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# modulator
# ----------------------------------------------------------------------------------------------------------
def _gate_params(c=6, d=D, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(c, d, generator=gen) * d ** -0.5 * scale, torch.randn(c, generator=gen) * scale,
            torch.randn(c, generator=gen) * scale, torch.tensor(0.5413))


def test_modulator_matches_its_formula():
    _, direction, _, _ = _lanes()
    weight, bias, coef, beta_raw = _gate_params()
    base = (torch.sigmoid(direction @ weight.T + bias) * torch.softmax(coef, 0)).sum(-1)
    expected = base ** F.softplus(beta_raw)
    torch.testing.assert_close(modulator(direction, weight, bias, coef, beta_raw), expected)


@pytest.mark.parametrize("scale", [1.0, 1e2, 1e4])
@pytest.mark.parametrize("beta_raw", [-20.0, -3.0, 0.5413, 3.0, 20.0])
def test_modulator_in_unit_interval(scale, beta_raw):
    _, direction, _, _ = _lanes(seed=int(scale))
    weight, bias, coef, _ = _gate_params(scale=scale, seed=int(scale))
    m = modulator(direction * scale, weight, bias, coef, torch.tensor(beta_raw))
    assert torch.isfinite(m).all()
    assert (m >= 0).all() and (m <= 1).all()


def test_modulator_gradient_finite_when_the_sigmoid_sum_underflows():
    _, direction, _, _ = _lanes()
    weight, _, coef, _ = _gate_params()
    weight.requires_grad_(True)
    bias = torch.full((6,), -1000.0, requires_grad=True)  # every sigmoid underflows to exactly 0
    beta_raw = torch.tensor(math.log(math.expm1(0.3)), requires_grad=True)  # beta = 0.3 < 1
    direction = direction.clone().requires_grad_(True)
    m = modulator(direction, weight, bias, coef.requires_grad_(True), beta_raw)
    assert torch.isfinite(m).all() and (m > 0).all()  # the floor, not 0
    m.sum().backward()
    for t in (direction, weight, bias, coef, beta_raw):
        assert torch.isfinite(t.grad).all()


# ----------------------------------------------------------------------------------------------------------
# rotation score
# ----------------------------------------------------------------------------------------------------------
def test_rotation_score_formula_and_zero_alpha_limit():
    m = torch.linspace(0, 1, 11)
    torch.testing.assert_close(rotation_score(torch.tensor(2.0), m), torch.atan(2.0 * m) / math.atan(2.0))
    alpha0 = torch.tensor(0.0, requires_grad=True)
    r0 = rotation_score(alpha0, m)
    torch.testing.assert_close(r0, m, atol=0, rtol=0)
    r0.sum().backward()
    assert torch.isfinite(alpha0.grad)
    for tiny in (1e-3, 1e-5, -1e-7):
        torch.testing.assert_close(rotation_score(torch.tensor(tiny), m), m, atol=1e-6, rtol=0)


def test_rotation_score_negative_alpha_stays_in_unit_interval():
    m = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    for alpha in (-0.3, -1.0, -7.0, -1e3):
        r = rotation_score(torch.tensor(alpha), m)
        assert (r >= 0).all() and (r <= 1).all()
        torch.testing.assert_close(r, rotation_score(torch.tensor(-alpha), m))
