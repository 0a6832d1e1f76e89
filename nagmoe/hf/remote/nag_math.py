"""The pure NAG (norm-agnostic residual) math: one sublayer update, the modulator, the rotation score.
Pure torch functions with no dependency inside nagmoe: the model (nagmoe.model.nag re-exports them, the
contract names) and the fused op (nagmoe.ops.nag_fused, whose eager backend and test oracle they are) both
import them from here.

Notation (see reference/nag.md): d = width; the stream is R = rho * R_bar with the direction R_bar of RMS 1
(norm sqrt(d)) and the log-norm s = log rho, one fp32 scalar per token. R itself is never materialised.
Shapes: vectors `(..., d)`; `log_norm`, `scale`, `m` are `(...)`.

All functions compute in at least fp32 (fp64 inputs stay fp64; the direction travels in the compute dtype,
bf16 on GPU) and return the direction in its input dtype, the log-norm in fp32 (or wider).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Tiny constant under square roots that should never bind for a live vector (RMS ~1).
_TINY = 1e-12
# Below this |alpha| the rotation score uses its limit m (arctan(a*m)/arctan(a) = m + O(a^2)).
_ALPHA_LIMIT = 1e-4


def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: at least fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_normalise(x: torch.Tensor) -> torch.Tensor:
    """x / RMS(x) over the last dim: the result has RMS 1 (norm sqrt(d))."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _TINY)


def branch_direction(direction: torch.Tensor, branch_out: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """u = N_out(f_perp): the branch output centred, made orthogonal to the direction and brought to RMS 1.

        f      = f - mean_features(f)
        f_perp = f - (<f, R_bar> / <R_bar, R_bar>) * R_bar
        u      = sqrt(d) * f_perp / sqrt(||f_perp||^2 + eps)

    eps keeps the Jacobian finite at f_perp = 0 (then u = 0: no rotation and, in `nag_update`, no norm
    gain), so gradient still reaches a zero-initialised output projection. Returned in >= fp32.
    """
    f = _acc(branch_out)
    r = _acc(direction)
    d = f.shape[-1]
    f = f - f.mean(-1, keepdim=True)
    along = (f * r).sum(-1, keepdim=True) / ((r * r).sum(-1, keepdim=True) + _TINY)
    f_perp = f - along * r
    return math.sqrt(d) * f_perp * torch.rsqrt(f_perp.pow(2).sum(-1, keepdim=True) + eps)


def nag_update(log_norm: torch.Tensor, direction: torch.Tensor, branch_out: torch.Tensor, scale,
               eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """One NAG sublayer update of the two lanes (s, R_bar) by the branch output f with scale g.

        u      = branch_direction(R_bar, f)                (u ⟂ R_bar, RMS(u) = 1 unless f_perp ~ 0)
        R_bar' = rms_normalise(R_bar + g * u)              (= (R_bar + g*u) / sqrt(1 + g^2) exactly)
        s'     = s + ½ · log1p(g^2 · mean(u^2))            (the exact norm gain of the step above)

    Rotation angle arctan(g), norm gain sqrt(1 + g^2), whatever the current norm. `scale` broadcasts
    against `log_norm` (a tensor of shape (...) or a scalar). Returns (log_norm fp32, direction in the
    input direction's dtype).
    """
    u = branch_direction(direction, branch_out, eps)
    g = _acc(torch.as_tensor(scale, device=u.device))
    g_vec = g.unsqueeze(-1) if g.dim() > 0 else g
    new_direction = rms_normalise(_acc(direction) + g_vec * u).to(direction.dtype)
    gain = 0.5 * torch.log1p(g.pow(2) * u.pow(2).mean(-1))
    return _acc(log_norm) + gain, new_direction


def modulator(direction: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, coef: torch.Tensor,
              beta_raw: torch.Tensor, floor: float = 1e-6) -> torch.Tensor:
    """The per-token modulator m ∈ [0, 1] from C learned directions (weight (C, d), bias (C,), coef (C,)):

        m = clamp(Σ_i softmax(coef)_i · sigmoid(<R_bar, w_i> + b_i), floor, 1) ** softplus(beta_raw)

    The base is a convex combination of sigmoids, in [0, 1]; the floor avoids the infinite gradient of
    x**beta at x = 0 when beta < 1 (the NaN run of the reimplementation), the ceiling only absorbs rounding.
    """
    logits = _acc(F.linear(direction, weight, bias))  # (..., C)
    base = (torch.sigmoid(logits) * torch.softmax(_acc(coef), dim=-1)).sum(-1)
    beta = F.softplus(_acc(beta_raw))
    return base.clamp(floor, 1.0).pow(beta)


def rotation_score(alpha: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """r = arctan(alpha·m) / arctan(alpha) ∈ [0, 1]: the rotation a sublayer would apply as a fraction of
    its ceiling arctan(alpha). Guarded: for |alpha| -> 0 the limit is m; a negative alpha gives the same r
    as |alpha| (arctan is odd), so r stays in [0, 1] because m ∈ [0, 1]."""
    alpha = _acc(torch.as_tensor(alpha, device=m.device))
    m = _acc(m)
    small = alpha.abs() < _ALPHA_LIMIT
    safe_alpha = torch.where(small, torch.ones_like(alpha), alpha)  # no 0/0, no NaN gradient
    r = torch.atan(safe_alpha * m) / torch.atan(safe_alpha)
    return torch.where(small, m, r).clamp(0.0, 1.0)
