"""The sublayers of the Hugging Face nagmoe model: an inference-only, eager rewrite of nagmoe's attention (MHA and
CCA), dense FFN and MoE. Self-contained: the standard library and torch only (nagmoe/hf/README: what each file
may import). Parameter names equal nagmoe's own, so an exported state dict is nagmoe's under one prefix.

Legend: B batch, T new tokens, L key positions (cached + new), D model width, H query heads, K key/value heads,
S head dim, R rotary dims, E experts, N = B·T tokens, k = top_k.

Padding (lm-eval's `generate_until` left-pads): `valid_BT` marks real tokens; a token's RoPE position counts
only real tokens before it; padded keys are masked; CCA's pre-conv latents and values of padded tokens are
zeroed, which is exactly the zero left-padding the causal convolutions and the value shift see at a sequence's
start, so a left-padded row equals the row alone.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding (nagmoe's convention, not transformers' rotate_half: the sign of the sine differs)
# ----------------------------------------------------------------------------------------------------------
def rope_tables(positions_BT: torch.Tensor, rot_dims: int, base: float):
    """cos, sin (B, T, R/2) fp32: angle(t, i) = position_t · base^(-2i/R)."""
    inv_freq = base ** (-torch.arange(0, rot_dims, 2, device=positions_BT.device, dtype=torch.float32) / rot_dims)
    angles = positions_BT.float().unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x_BTHS: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x1·cos + x2·sin, x2·cos - x1·sin) on the leading R dims of each head (fp32 math)."""
    half = cos_BTR.shape[-1]
    if half == 0:
        return x_BTHS
    rot, rest = x_BTHS[..., : 2 * half].float(), x_BTHS[..., 2 * half:]
    x1, x2 = rot[..., :half], rot[..., half:]
    cos, sin = cos_BTR[:, :, None, :], sin_BTR[:, :, None, :]
    rotated = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(x_BTHS.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


class Linear(nn.Linear):
    """nn.Linear that reads its input in its weight's dtype (a bf16 export keeps an fp32 residual stream)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim (torch's eps: the dtype's machine epsilon)."""
    return F.rms_norm(x, (x.shape[-1],))


# ----------------------------------------------------------------------------------------------------------
# Decoding state
# ----------------------------------------------------------------------------------------------------------
class LayerCache:
    """One attention sublayer's decoding state: keys (normalised, rotated) and values of every position so far,
    and for CCA the raw [q0|k0] latents of the last W tokens and the shifted value half of the last token."""

    def __init__(self):
        self.k_BKLS: Optional[torch.Tensor] = None
        self.v_BKLS: Optional[torch.Tensor] = None
        self.conv_BCW: Optional[torch.Tensor] = None
        self.shift_BN: Optional[torch.Tensor] = None

    def append(self, k_BKTS: torch.Tensor, v_BKTS: torch.Tensor):
        if self.k_BKLS is None:
            self.k_BKLS, self.v_BKLS = k_BKTS, v_BKTS
        else:
            self.k_BKLS = torch.cat([self.k_BKLS, k_BKTS], dim=2)
            self.v_BKLS = torch.cat([self.v_BKLS, v_BKTS], dim=2)
        return self.k_BKLS, self.v_BKLS


class Context:
    """What every attention sublayer of one forward call shares: RoPE positions of the new tokens, which of them
    are real (None: all), the key mask (B, T, L) and the layer caches (None: no cache)."""

    def __init__(self, positions_BT, valid_BT, visible_BTL, caches):
        self.positions_BT, self.valid_BT, self.visible_BTL, self.caches = positions_BT, valid_BT, visible_BTL, caches


def attend(q_BHTS: torch.Tensor, k_BKLS: torch.Tensor, v_BKLS: torch.Tensor, visible_BTL: torch.Tensor):
    """softmax(q kᵀ / sqrt(S), masked) v in fp32 math; query head h reads key/value head h // (H/K)."""
    n_rep = q_BHTS.shape[1] // k_BKLS.shape[1]
    k_BHLS = k_BKLS.repeat_interleave(n_rep, dim=1)
    v_BHLS = v_BKLS.repeat_interleave(n_rep, dim=1)
    scores_BHTL = (q_BHTS.float() @ k_BHLS.float().transpose(-2, -1)) / math.sqrt(q_BHTS.shape[-1])
    scores_BHTL = scores_BHTL.masked_fill(~visible_BTL.unsqueeze(1), float("-inf"))
    return torch.softmax(scores_BHTL, dim=-1) @ v_BHLS.float()


def zero_padding(x_BT_: torch.Tensor, valid_BT: Optional[torch.Tensor]) -> torch.Tensor:
    if valid_BT is None:
        return x_BT_
    return x_BT_ * valid_BT.view(*valid_BT.shape, *([1] * (x_BT_.dim() - 2))).to(x_BT_.dtype)


class MultiHeadAttention(nn.Module):
    """MHA/GQA: c_q, c_k, c_v, c_proj, RoPE on q and k, then the optional parameter-free QK RMS-norm."""

    def __init__(self, layout: dict, d_model: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = layout["n_heads"], layout["n_kv_heads"], layout["head_dim"]
        self.rot_dims, self.rope_base, self.qk_norm = layout["rot_dims"], layout["rope_base"], layout["qk_norm"]
        H, K, S = self.n_heads, self.n_kv_heads, self.head_dim
        self.c_q = Linear(d_model, H * S, bias=False)
        self.c_k = Linear(d_model, K * S, bias=False)
        self.c_v = Linear(d_model, K * S, bias=False)
        self.c_proj = Linear(H * S, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, ctx: Context, cache: Optional[LayerCache]) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, K, S = self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin = rope_tables(ctx.positions_BT, self.rot_dims, self.rope_base)
        q_BTHS = apply_rope(self.c_q(x_BTD).view(B, T, H, S), cos, sin)
        k_BTKS = apply_rope(self.c_k(x_BTD).view(B, T, K, S), cos, sin)
        if self.qk_norm:
            q_BTHS, k_BTKS = rms_norm(q_BTHS), rms_norm(k_BTKS)
        k_BKLS, v_BKLS = k_BTKS.transpose(1, 2), self.c_v(x_BTD).view(B, T, K, S).transpose(1, 2)
        if cache is not None:
            k_BKLS, v_BKLS = cache.append(k_BKLS, v_BKLS)
        y_BHTS = attend(q_BTHS.transpose(1, 2), k_BKLS, v_BKLS, ctx.visible_BTL)
        return self.c_proj(y_BHTS.transpose(1, 2).reshape(B, T, H * S))


def value_shift(v_BTJ: torch.Tensor, shifted: int, before_BN: Optional[torch.Tensor]) -> torch.Tensor:
    """v_t = [first channels of c_v(x_t) | last `shifted` channels of c_v(x_{t-1})]; x_{-1} = 0 or the cache."""
    if shifted == 0:
        return v_BTJ
    current_BTJ, prev_BTN = v_BTJ[..., :-shifted], v_BTJ[..., -shifted:]
    before_B1N = (prev_BTN.new_zeros(prev_BTN.shape[0], 1, shifted) if before_BN is None
                  else before_BN.unsqueeze(1))
    return torch.cat([current_BTJ, torch.cat([before_B1N, prev_BTN[:, :-1]], dim=1)], dim=-1)


class CompressedConvAttention(nn.Module):
    """CCA / CCGQA (reference: nagmoe/model/cca.py): attention in a compressed latent with causal convolutions on
    [q0|k0], the q-k mean skip, the value shift, QK L2-norm with a per-kv-head temperature, then RoPE."""

    def __init__(self, layout: dict, d_model: int):
        super().__init__()
        H, K, S = layout["n_heads"], layout["n_kv_heads"], layout["head_dim"]
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, S
        self.rot_dims, self.rope_base = layout["rot_dims"], layout["rope_base"]
        self.use_convs, self.use_qk_mean = layout["use_convs"], layout["use_qk_mean"]
        self.shifted = K * S // 2 if layout["use_value_shift"] else 0
        C = (H + K) * S
        self.c_q = Linear(d_model, H * S, bias=False)
        self.c_k = Linear(d_model, K * S, bias=False)
        self.c_v = Linear(d_model, K * S, bias=False)
        self.c_proj = Linear(H * S, d_model, bias=False)
        self.conv_history = 0
        if self.use_convs:
            k1, k2 = layout["conv_kernel_1"], layout["conv_kernel_2"]
            self.conv_seq = nn.Conv1d(C, C, k1, groups=C)
            self.conv_head = nn.Conv1d(C, C, k2, groups=H + K)
            self.conv_history = (k1 - 1) + (k2 - 1)
        self.log_temperature = nn.Parameter(torch.zeros(K))

    def _convs(self, qk_BTC: torch.Tensor, cache: Optional[LayerCache]) -> torch.Tensor:
        W = self.conv_history
        qk_BCT = qk_BTC.transpose(1, 2)
        history_BCW = (cache.conv_BCW if cache is not None and cache.conv_BCW is not None
                       else qk_BCT.new_zeros(*qk_BCT.shape[:2], W))
        qk_BCL = torch.cat([history_BCW.to(qk_BCT.dtype), qk_BCT], dim=-1)
        if cache is not None:
            cache.conv_BCW = qk_BCL[..., qk_BCL.shape[-1] - W:]
        return self.conv_head(self.conv_seq(qk_BCL.to(self.conv_seq.weight.dtype))).transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, ctx: Context, cache: Optional[LayerCache]) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        H, K, S = self.n_heads, self.n_kv_heads, self.head_dim
        q0_BTQ = zero_padding(self.c_q(x_BTD), ctx.valid_BT)
        k0_BTJ = zero_padding(self.c_k(x_BTD), ctx.valid_BT)
        if self.use_convs:
            qk_BTC = self._convs(torch.cat([q0_BTQ, k0_BTJ], dim=-1), cache)
            q_BTHS, k_BTKS = qk_BTC[..., : H * S].reshape(B, T, H, S), qk_BTC[..., H * S:].reshape(B, T, K, S)
        else:
            q_BTHS, k_BTKS = q0_BTQ.view(B, T, H, S), k0_BTJ.view(B, T, K, S)
        if self.use_qk_mean:  # mean_q[h] = ½ (q0[h] + k0[h // G]); mean_k[j] = mean over group j of mean_q
            mean_q_BTHS = 0.5 * (q0_BTQ.view(B, T, H, S) + k0_BTJ.view(B, T, K, S).repeat_interleave(H // K, dim=2))
            q_BTHS = q_BTHS + mean_q_BTHS
            k_BTKS = k_BTKS + mean_q_BTHS.view(B, T, K, H // K, S).mean(dim=3)
        v_BTJ = zero_padding(self.c_v(x_BTD), ctx.valid_BT)
        before_BN = cache.shift_BN if cache is not None else None
        if cache is not None and self.shifted:
            cache.shift_BN = v_BTJ[:, -1, -self.shifted:]
        v_BTKS = value_shift(v_BTJ, self.shifted, before_BN).view(B, T, K, S)
        cos, sin = rope_tables(ctx.positions_BT, self.rot_dims, self.rope_base)
        temperature_K1 = self.log_temperature.exp().to(k_BTKS.dtype).unsqueeze(-1)
        k_BTKS = apply_rope(rms_norm(k_BTKS) * temperature_K1, cos, sin)
        q_BTHS = apply_rope(rms_norm(q_BTHS), cos, sin)
        k_BKLS, v_BKLS = k_BTKS.transpose(1, 2), v_BTKS.transpose(1, 2)
        if cache is not None:
            k_BKLS, v_BKLS = cache.append(k_BKLS, v_BKLS)
        y_BHTS = attend(q_BTHS.transpose(1, 2), k_BKLS, v_BKLS, ctx.visible_BTL)
        return self.c_proj(y_BHTS.transpose(1, 2).reshape(B, T, H * S))


# ----------------------------------------------------------------------------------------------------------
# Feed-forward sublayers
# ----------------------------------------------------------------------------------------------------------
def relu_squared(h: torch.Tensor) -> torch.Tensor:
    r = F.relu(h)
    return r * r


class DenseMLP(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.c_fc = Linear(d_model, hidden, bias=False)
        self.c_proj = Linear(hidden, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.c_proj(relu_squared(self.c_fc(x_BTD)))


def route(logits_NE: torch.Tensor, top_k: int, bias_E: Optional[torch.Tensor] = None):
    """(gate_Nk, expert_Nk): the top-k of the fp32 softmax, NOT renormalised over the k. An expert bias (load
    balancing) shifts only the selection key; the gates stay the unbiased probabilities."""
    probs_NE = logits_NE.softmax(dim=-1)
    if bias_E is None:
        return probs_NE.topk(top_k, dim=-1)
    expert_Nk = (probs_NE + bias_E.to(probs_NE.dtype)).topk(top_k, dim=-1).indices
    return probs_NE.gather(1, expert_Nk), expert_Nk


class Router(nn.Linear):
    """Linear(d, E, bias=False) read in fp32, autocast off (as nagmoe routes under bf16 autocast)."""

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            return F.linear(x_ND.float(), self.weight.float())


class MoELayer(nn.Module):
    """Dropless top-k MoE with ReLU² experts; y = Σ_k gate_k · expert_k(x). `last_choices` (N, k): the experts
    of the last call (read by the export's validation)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, hidden: int, expert_bias: bool = False):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = Router(d_model, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.zeros(n_experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.zeros(n_experts, hidden, d_model))
        if expert_bias:  # the run's loss-free balancing bias: on the selection key only
            self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.last_choices: Optional[torch.Tensor] = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        gate_Nk, expert_Nk = route(self.router(x_ND), self.top_k, self.expert_bias)
        self.last_choices = expert_Nk
        y_NkD = x_ND.new_zeros(B * T, self.top_k, D)
        for e in range(self.n_experts):
            n_idx, k_idx = (expert_Nk == e).nonzero(as_tuple=True)
            if n_idx.numel():
                y_NkD[n_idx, k_idx] = (relu_squared(x_ND[n_idx].to(self.w_in.dtype) @ self.w_in[e]) @ self.w_out[e]).to(y_NkD.dtype)
        y_ND = (y_NkD * gate_Nk.unsqueeze(-1).to(y_NkD.dtype)).sum(dim=1, dtype=y_NkD.dtype)
        return y_ND.view(B, T, D)
