"""Pick a valid MoE layout for a target total / active parameter count at a width-to-depth ratio.

Search space (small, exhaustive): n_layers, d_model a multiple of the head dim with d_model / n_layers
close to the ratio, head_dim in {64, 128} (or the base config's `attention.head_dim` when it sets one),
n_experts (multiples of 8, so expert parallelism up to 8 divides them), top_k, expert_hidden a multiple of
64 and at most 4 x d_model. Counts come from `nagmoe.config.flops.param_counts`, so the solver and the accounting
can never disagree. The score is the worse of the relative errors (total, active; of the NAG model and its
pre-norm twin), plus a small penalty for missing the ratio.

The attention kind and its compression are inputs (default: the base config's): n_heads = d_model /
head_dim is the reference head count, and for CCA/CCGQA only widths whose head count the compressions divide
are considered (H = n_heads / q_compression query heads, K = n_heads / kv_compression kv heads). CCA's
attention is ~1/C of MHA's parameters, which the solver gives back to depth, width or experts.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from nagmoe.config import ModelConfig
from nagmoe.base.errors import UserError
from nagmoe.config.flops import attention_heads, param_counts


@dataclass
class Layout:
    model: ModelConfig
    total: int
    active: int
    ratio: float
    error: float


def _with(m: ModelConfig, d: int, L: int, hd: int, E: int, k: int, H: int) -> ModelConfig:
    c = copy.deepcopy(m)
    c.d_model, c.n_layers = d, L
    c.attention.n_heads, c.attention.head_dim, c.attention.n_kv_heads = d // hd, None, None
    c.ffn = "moe"
    c.moe.n_experts, c.moe.top_k, c.moe.expert_hidden = E, k, H
    if c.residual == "nag":
        c.nag.C = max(c.nag.C, E)
    return c


def _heads_fit(c: ModelConfig) -> bool:
    """Whether the attention geometry exists (CCA: the compressions divide the head count)."""
    try:
        attention_heads(c)
    except UserError:
        return False
    return True


def solve_layout(base: ModelConfig, total: float, active: float, ratio: float,
                 experts=(8, 16, 24, 32, 48, 64, 96, 128), top_ks=(1, 2, 4, 8), head_dims=None,
                 ratio_tolerance: float = 0.1, max_hidden_mult: float = 4.0,
                 both_residuals: bool = True, attention_kind: Optional[str] = None,
                 q_compression: Optional[int] = None, kv_compression: Optional[int] = None,
                 total_tolerance: Optional[float] = None, active_tolerance: Optional[float] = None) -> Layout:
    """The layout closest to the targets; `attention_kind` (mha | cca) and the CCA compressions default to
    the base config's. With tolerances (relative, e.g. 0.10 total / 0.05 active) only layouts inside both
    count, scored by the larger error as a fraction of its tolerance: the controlled sweep fixes n_experts
    and top_k, so total - active is fixed by the expert width and total cannot be hit as closely as active."""
    base = copy.deepcopy(base)
    a = base.attention
    a.kind = attention_kind or a.kind
    a.q_compression = q_compression or a.q_compression
    a.kv_compression = kv_compression or a.kv_compression
    if head_dims is None:
        head_dims = (a.head_dim,) if a.head_dim else (64, 128)
    best = None
    for L in range(4, 97):
        for hd in head_dims:
            d = max(hd, round(ratio * L / hd) * hd)
            r = d / L
            if abs(r / ratio - 1) > ratio_tolerance:
                continue
            if not _heads_fit(_with(base, d, L, hd, experts[0], 1, 64)):
                continue
            for E in experts:
                for k in top_ks:
                    if k > E:
                        continue
                    # active is linear in H: solve for H from the target, then round to 64.
                    c0 = param_counts(_with(base, d, L, hd, E, k, 64))
                    c1 = param_counts(_with(base, d, L, hd, E, k, 128))
                    slope = (c1["active"] - c0["active"]) / 64
                    H_exact = 64 + (active - c0["active"]) / slope
                    for H in {max(64, int(H_exact // 64) * 64), max(64, int(H_exact // 64 + 1) * 64)}:
                        if H > max_hidden_mult * d:  # keep experts no wider than a dense MLP
                            continue
                        c = _with(base, d, L, hd, E, k, H)
                        n = param_counts(c)
                        counts = [n]
                        if both_residuals:  # the pre-norm twin (no NAG gates) must hit the targets too
                            twin = copy.deepcopy(c)
                            twin.residual = "prenorm"
                            counts.append(param_counts(twin))
                        e_total = max(abs(x["total"] / total - 1) for x in counts)
                        e_active = max(abs(x["active"] / active - 1) for x in counts)
                        err = max(e_total, e_active)
                        if total_tolerance is not None and active_tolerance is not None:
                            if e_total > total_tolerance or e_active > active_tolerance:
                                continue
                            score = max(e_total / total_tolerance, e_active / active_tolerance) + abs(r / ratio - 1)
                        else:
                            score = err + abs(r / ratio - 1)  # both errors count alike
                        if best is None or score < best[0]:
                            best = (score, Layout(c, n["total"], n["active"], r, err))
    if best is None:
        raise ValueError(f"no layout found for ratio {ratio} with attention {a.kind} experts {experts} top_k {top_ks} "
                         f"(q_compression {a.q_compression}, kv_compression {a.kv_compression})")
    return best[1]
