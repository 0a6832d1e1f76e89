"""Compressed Convolutional Attention (CCA) and its grouped variant CCGQA (reference/cca.md; Figliolia et
al. 2025, arXiv 2510.04476): the whole attention runs in a compressed latent, only the output projection
returns to the model width.

Legend: B batch, T sequence (the new tokens when decoding), L key positions (cached + new), D model width,
H query heads, K key/value heads (G = H / K query heads per kv head), S head dim, Q = H·S and J = K·S latent
widths, C = Q + J channels of the concatenated [q|k] latent, W = (k1 - 1) + (k2 - 1) tokens of convolution
history, N value channels taken from the previous token (J / 2).

Geometry (`nagmoe.config.flops.attention_heads`): `n_heads` is the reference head count, H = n_heads /
q_compression, K = n_heads / kv_compression, S = d_model / n_heads unless `head_dim` is set. CCA when H = K,
CCGQA when H > K.

Forward, per token t:
  1. q0 = c_q(x) (H·S), k0 = c_k(x) (K·S), v0 = c_v(x) (K·S); no biases.
  2. convs on [q0|k0] over time, causal: left-pad W zeros, depthwise conv (kernel k1, bias), then a conv
     grouped per head (H + K groups, kernel k2, bias) that mixes the S channels of a head across time.
  3. q-k mean skip from the *pre-conv* latents, added after the convs:
       mean_q[h] = ½ (q0[h] + k0[h // G]),   mean_k[j] = mean_{h in group j} mean_q[h];
       q = conv_q + mean_q,  k = conv_k + mean_k        (G = 1: both are ½ (q0 + k0)).
  4. value shift: the last half of v0's channels are taken from the previous token,
       v_t = [W_v1 x_t | W_v2 x_{t-1}] (x_{-1} = 0), then viewed as (K, S).
  5. QK L2-norm and temperature: q = sqrt(S)·q/|q| per head, k = sqrt(S)·k/|k|·exp(T_j) per kv head j
     (`log_temperature`, T = 0 at init; the exp keeps the keys non-zero, unlike a raw zero-initialised τ).
  6. RoPE (leading rope_fraction of S) on the normalised q, k; 7. causal softmax attention, scale 1/sqrt(S);
  8. c_proj (H·S -> D), zero-initialised.
  Under MoD (`select`) steps 1-6 run for every token's keys/values (and q0 for the convs); the query side of
  5-6, the score rows of 7 and step 8 only for the executed tokens (see attention.py).
Convolutions, q-k mean and value shift are switchable (`use_convs`, `use_qk_mean`, `use_value_shift`);
with all three off this is a plain latent multi-head attention (the tests check it against
`MultiHeadAttention` with the same weights).

Decoding state (`AttentionCache`): K (after norm, temperature and RoPE) and V (value-shifted); the raw
[q0|k0] of the last W tokens (`conv_BCW`, so a new token's convs see exactly what the full sequence would);
the W_v2 x_{t-1} half of the last token's value projection (`shift_BC`).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from nagmoe.base.errors import UserError
from nagmoe.config.flops import attention_heads
from nagmoe.model.attention import (AttentionCache, apply_rope, attention_at_positions, causal_attention,
                                    executed_queries, resolve_attention_impl, rope_tables, rotary_dims)
from nagmoe.model.mod import Selection, decide
from nagmoe.model.common import init_linear_uniform, rms_norm
from nagmoe.model.init_rng import ParamInit
from nagmoe.model.roles import SCALAR
from nagmoe.ops.causal_conv import depthwise_causal_conv, grouped_causal_conv


def qk_mean(q0_BTHS: torch.Tensor, k0_BTKS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The q-k mean skip: mean_q[h] = ½ (q0[h] + k0[h // G]); mean_k[j] = mean over the G query heads h of
    group j of mean_q[h] = ½ (mean_{h in j} q0[h] + k0[j])."""
    B, T, H, S = q0_BTHS.shape
    K = k0_BTKS.shape[2]
    mean_q_BTHS = 0.5 * (q0_BTHS + k0_BTKS.repeat_interleave(H // K, dim=2))
    mean_k_BTKS = mean_q_BTHS.view(B, T, K, H // K, S).mean(dim=3)
    return mean_q_BTHS, mean_k_BTKS


class CCAttention(nn.Module):
    """CCA / CCGQA: `forward(x_BTD, cache=None) -> (y_BTD, None)`.

    Parameters: c_q (H·S, D), c_k, c_v (K·S, D), c_proj (D, H·S) (role matrix, c_proj zero-init);
    conv_seq (depthwise, C x 1 x k1, bias) and conv_head (grouped, C x S x k2, bias), nn.Conv1d so role
    conv (AdamW); log_temperature (K,) role scalar, zeros.
    """

    param_roles = {"log_temperature": SCALAR}

    def __init__(self, d_model: int, attn_cfg, init_std: Optional[float] = None):
        super().__init__()
        # sizes from the accounting's own function, so that model and nagmoe.config.flops can never disagree
        H, K, S = attention_heads(SimpleNamespace(d_model=d_model, attention=attn_cfg))
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, S
        self.channels = C = (H + K) * S
        self.use_convs, self.use_qk_mean = attn_cfg.use_convs, attn_cfg.use_qk_mean
        self.use_value_shift = attn_cfg.use_value_shift
        self.shifted = K * S // 2 if self.use_value_shift else 0  # value channels from the previous token
        self.rope_base = attn_cfg.rope_base
        self.rot_dims = rotary_dims(self.head_dim, attn_cfg.rope_fraction)
        self.impl = resolve_attention_impl(attn_cfg.impl)
        self.ran: dict[str, str] = {}  # the kernels the last call ran (nagmoe.train.backends_ran), no sync
        self.init_std = init_std if init_std is not None else d_model ** -0.5
        self.c_q = nn.Linear(d_model, H * S, bias=False)
        self.c_k = nn.Linear(d_model, K * S, bias=False)
        self.c_v = nn.Linear(d_model, K * S, bias=False)
        self.c_proj = nn.Linear(H * S, d_model, bias=False)
        self.conv_history = 0
        if self.use_convs:
            k1, k2 = attn_cfg.conv_kernel_1, attn_cfg.conv_kernel_2
            if k1 < 1 or k2 < 1:
                raise UserError(f"model.attention.conv_kernel_1/2: {k1}, {k2} must be >= 1")
            self.conv_seq = nn.Conv1d(C, C, k1, groups=C)  # depthwise
            self.conv_head = nn.Conv1d(C, C, k2, groups=H + K)  # one group per head
            self.conv_history = (k1 - 1) + (k2 - 1)
        self.conv_impl = "auto"  # auto | conv | shift (`_convs`)
        self.log_temperature = nn.Parameter(torch.empty(K))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weights(ParamInit())

    def init_weights(self, init: ParamInit) -> None:
        for lin in ("c_q", "c_k", "c_v"):
            init_linear_uniform(self, lin, self.init_std, init)
        init.zeros_(self, "c_proj.weight")
        if self.use_convs:  # PyTorch's default conv init (kaiming-uniform weights and biases)
            init.conv_default_(self, "conv_seq")
            init.conv_default_(self, "conv_head")
        init.zeros_(self, "log_temperature")

    # ------------------------------------------------------------------------------------------------------
    def _convs(self, qk_BTC: torch.Tensor, cache: Optional[AttentionCache]) -> torch.Tensor:
        """Both causal convs over time; the W raw tokens before this chunk come from the cache (zeros at the
        start, which is the causal left-padding of the full sequence). `conv_impl`: "conv" the nn.Conv1d ops
        in (B, C, T), "shift" the same maths as shifts + einsum in (B, T, C) (nagmoe/ops/causal_conv.py, no
        transposes; equal to fp32 rounding); "auto" (default) "shift" inside a compiled graph, "conv" eagerly,
        so that the eager CPU path (make demo) runs exactly today's ops. The cache keeps its (B, C, W) layout."""
        if self.conv_impl == "shift" or (self.conv_impl == "auto" and torch.compiler.is_compiling()):
            return self._shift_convs(qk_BTC, cache)
        W = self.conv_history
        qk_BCT = qk_BTC.transpose(1, 2)
        if cache is None:
            qk_BCL = F.pad(qk_BCT, (W, 0))
        else:
            history_BCW = cache.conv_BCW if cache.conv_BCW is not None else qk_BCT.new_zeros(*qk_BCT.shape[:2], W)
            qk_BCL = torch.cat([history_BCW, qk_BCT], dim=-1)
            cache.conv_BCW = qk_BCL[..., qk_BCL.shape[-1] - W:].clone()
        # contiguous (B, T, C): a channel-last view would reach SDPA with head-dim stride T, which its fused
        # CPU kernel rejects (silently falling back to the unfused math path)
        return self.conv_head(self.conv_seq(qk_BCL)).transpose(1, 2).contiguous()

    def _shift_convs(self, qk_BTC: torch.Tensor, cache: Optional[AttentionCache]) -> torch.Tensor:
        """`_convs` as shifts + einsum on the left-padded (B, W + T, C) tokens; same parameters, same cache."""
        B, T, C = qk_BTC.shape
        W = self.conv_history
        if cache is None or cache.conv_BCW is None:
            history_BWC = qk_BTC.new_zeros(B, W, C)
        else:
            history_BWC = cache.conv_BCW.transpose(1, 2)
        qk_BLC = torch.cat([history_BWC, qk_BTC], dim=1)
        if cache is not None:  # the (B, C, W) layout of the conv path, a copy (not a view of this chunk)
            last_BCW = qk_BLC[:, qk_BLC.shape[1] - W:].transpose(1, 2)
            cache.conv_BCW = last_BCW.clone(memory_format=torch.contiguous_format)
        seq, head = self.conv_seq, self.conv_head
        qk_BMC = depthwise_causal_conv(qk_BLC, seq.weight, seq.bias)  # M = T + k2 - 1
        return grouped_causal_conv(qk_BMC, head.weight, head.bias, head.groups)

    def _value_shift(self, v_BTJ: torch.Tensor, cache: Optional[AttentionCache]) -> torch.Tensor:
        """v_t = [first channels of c_v(x_t) | last `shifted` channels of c_v(x_{t-1})] (linear, so shifting the
        projection equals projecting the shifted input); x_{-1} = 0, or the cached last token."""
        n = self.shifted
        if n == 0:
            return v_BTJ
        current_BTJ, prev_proj_BTN = v_BTJ[..., :-n], v_BTJ[..., -n:]
        if cache is not None and cache.shift_BC is not None:
            before_B1N = cache.shift_BC.unsqueeze(1)
        else:
            before_B1N = prev_proj_BTN.new_zeros(prev_proj_BTN.shape[0], 1, n)
        if cache is not None:
            cache.shift_BC = prev_proj_BTN[:, -1].clone()
        shifted_BTN = torch.cat([before_B1N, prev_proj_BTN[:, :-1]], dim=1)
        return torch.cat([current_BTJ, shifted_BTN], dim=-1)

    def latents(self, x_BTD: torch.Tensor, cache: Optional[AttentionCache] = None):
        """q (B,T,H,S), k (B,T,K,S), v (B,T,K,S) in the latent, before QK-norm and RoPE (steps 1-4)."""
        B, T, _ = x_BTD.shape
        H, K, S = self.n_heads, self.n_kv_heads, self.head_dim
        q0_BTQ, k0_BTJ = self.c_q(x_BTD), self.c_k(x_BTD)
        if self.use_convs:
            qk_BTC = self._convs(torch.cat([q0_BTQ, k0_BTJ], dim=-1), cache)
            q_BTHS, k_BTKS = qk_BTC[..., : H * S].view(B, T, H, S), qk_BTC[..., H * S:].view(B, T, K, S)
        else:
            q_BTHS, k_BTKS = q0_BTQ.view(B, T, H, S), k0_BTJ.view(B, T, K, S)
        if self.use_qk_mean:
            mean_q_BTHS, mean_k_BTKS = qk_mean(q0_BTQ.view(B, T, H, S), k0_BTJ.view(B, T, K, S))
            q_BTHS, k_BTKS = q_BTHS + mean_q_BTHS, k_BTKS + mean_k_BTKS
        v_BTKS = self._value_shift(self.c_v(x_BTD), cache).view(B, T, K, S)
        return q_BTHS, k_BTKS, v_BTKS

    def forward(self, x_BTD: torch.Tensor, cache: Optional[AttentionCache] = None, select=None):
        """`(y_BTD, None)`; with `select` (MoD, nagmoe.model.mod.ExecutedTokens) `(y_ND, None)` for the N
        executed tokens: the latents, convs, keys and values still run on every token (the convs and the q-k
        mean read every token's raw q0, k0), only the executed queries' score rows and c_proj are computed."""
        select = decide(select)  # static MoD: the decision inside this sublayer's compiled unit
        B, T, _ = x_BTD.shape
        H, S = self.n_heads, self.head_dim
        offset = cache.length if cache is not None else 0
        q_BTHS, k_BTKS, v_BTKS = self.latents(x_BTD, cache)
        temperature_K1 = self.log_temperature.exp().to(k_BTKS.dtype).unsqueeze(-1)
        k_BTKS = rms_norm(k_BTKS) * temperature_K1  # sqrt(S)·x/|x| = x / rms(x)
        cos, sin = rope_tables(T, self.rot_dims, self.rope_base, x_BTD.device, offset=offset)
        k_BTKS = apply_rope(k_BTKS, cos, sin)
        k_BKLS, v_BKLS = k_BTKS.transpose(1, 2), v_BTKS.transpose(1, 2)
        if cache is not None:
            k_BKLS, v_BKLS = cache.append(k_BKLS, v_BKLS)
        if select is None or isinstance(select, Selection):  # static MoD: every query; the stream keeps its rows
            q_BTHS = apply_rope(rms_norm(q_BTHS), cos, sin)
            y_BHTS = causal_attention(q_BTHS.transpose(1, 2), k_BKLS, v_BKLS, self.impl, q_offset=offset,
                                      ran=self.ran)
            return self.c_proj(y_BHTS.transpose(1, 2).reshape(B, T, H * S)), None
        # every token's latent query exists already (the convs need it): one copy into the padded layout
        q_BMHS, positions_BM = executed_queries(rms_norm(select.gather_padded(q_BTHS)), cos, sin, select, offset)
        y_BHMS = attention_at_positions(q_BMHS.transpose(1, 2), k_BKLS, v_BKLS, self.impl, positions_BM,
                                        key_ends=select.key_ends_at(offset), chunks=select.position_chunks(offset),
                                        ran=self.ran)
        return self.c_proj(select.from_padded(y_BHMS.transpose(1, 2)).reshape(-1, H * S)), None
