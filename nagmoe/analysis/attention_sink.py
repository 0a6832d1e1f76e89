"""Attention sink: how much attention each layer puts on the first key (the BOS of a BOS-aligned window).

Legend: B batch, T queries, L keys (= T here), H query heads, K key/value heads, S head dim.

The probabilities are recomputed from the attention module's own input (captured by a pre-hook,
`nagmoe.analysis.capture`) with the module's own projections, norms and RoPE, in the order its forward uses:
- `mha`: q = c_q(x), k = c_k(x) -> RoPE -> QK RMS-norm (when enabled);
- `cca`: (q, k, v) = attn.latents(x) -> q = rmsnorm(q), k = rmsnorm(k)·exp(T) -> RoPE;
then p = softmax(q·kᵀ/sqrt(S) + causal mask) in fp32 (a kv head serves H/K query heads). `attention_inputs` also
returns v, so a test can check that `c_proj(p·v)` reproduces the module's output.

Per layer the statistic is the mean over batch rows, heads and query positions t >= 1 of p[t, key 0] (query 0
sees only key 0, so it would count a trivial 1); under MoD only the queries that executed the attention count. Uniform attention gives 1/(t+1) at 0-based query t. A layer
"sinks" when its mean exceeds 50%. `bos_mass` is the mass on *any* BOS key a query sees (later documents in the
window start with BOS too).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from nagmoe.model.attention import MultiHeadAttention, apply_rope, rope_tables
from nagmoe.model.common import rms_norm

QUERY_CHUNK = 256  # queries per score block: (B, H, chunk, L) fp32 at a time


def attention_inputs(attn, x_BTD: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q_BHTS, k_BKTS, v_BKTS) exactly as the module's scores use them (positions from 0), or None for an
    attention kind this does not know."""
    B, T, _ = x_BTD.shape
    cos, sin = rope_tables(T, attn.rot_dims, attn.rope_base, x_BTD.device)
    if isinstance(attn, MultiHeadAttention):
        q = attn.c_q(x_BTD).view(B, T, attn.n_heads, attn.head_dim)
        k = attn.c_k(x_BTD).view(B, T, attn.n_kv_heads, attn.head_dim)
        v = attn.c_v(x_BTD).view(B, T, attn.n_kv_heads, attn.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attn.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
    elif hasattr(attn, "latents") and hasattr(attn, "log_temperature"):  # CCA / CCGQA
        q, k, v = attn.latents(x_BTD)
        q = rms_norm(q)
        k = rms_norm(k) * attn.log_temperature.exp().to(k.dtype).unsqueeze(-1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    else:
        return None
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def attention_prob_blocks(q_BHTS: torch.Tensor, k_BKLS: torch.Tensor, chunk: int = QUERY_CHUNK):
    """Yield (t0, p_BHtL): causal softmax probabilities of queries t0 .. t0+t-1 over all L keys, fp32."""
    H, K = q_BHTS.shape[1], k_BKLS.shape[1]
    k_BHLS = k_BKLS.float().repeat_interleave(H // K, dim=1)
    T, L, S = q_BHTS.shape[2], k_BHLS.shape[2], q_BHTS.shape[3]
    keys_L = torch.arange(L, device=q_BHTS.device)
    for t0 in range(0, T, chunk):
        q_BHtS = q_BHTS[:, :, t0:t0 + chunk].float()
        scores_BHtL = q_BHtS @ k_BHLS.transpose(-2, -1) / math.sqrt(S)
        queries_t = torch.arange(t0, t0 + q_BHtS.shape[2], device=q_BHTS.device) + (L - T)
        scores_BHtL = scores_BHtL.masked_fill(keys_L[None, :] > queries_t[:, None], float("-inf"))
        yield t0, torch.softmax(scores_BHtL, dim=-1)


def first_key_mass(q_BHTS: torch.Tensor, k_BKLS: torch.Tensor, is_bos_BL: Optional[torch.Tensor] = None):
    """(first_BT, bos_BT): per row and query position, the attention mass on key 0 and on BOS keys (None
    without `is_bos_BL`), averaged over heads."""
    B, _, T, _ = q_BHTS.shape
    first_BT = torch.empty(B, T, dtype=torch.float32, device=q_BHTS.device)
    bos_BT = torch.empty_like(first_BT) if is_bos_BL is not None else None
    for t0, p_BHtL in attention_prob_blocks(q_BHTS, k_BKLS):
        t1 = t0 + p_BHtL.shape[2]
        first_BT[:, t0:t1] = p_BHtL[..., 0].mean(dim=1)
        if is_bos_BL is not None:
            bos_BT[:, t0:t1] = (p_BHtL * is_bos_BL[:, None, None, :].float()).sum(-1).mean(dim=1)
    return first_BT, bos_BT


class SinkAccumulator:
    """Sums of the per-layer first-key and BOS masses over the counted queries of every batch: positions
    t >= 1 and, under MoD, only the queries that executed the attention (`select.mask_BT`)."""

    def __init__(self, n_layers: int):
        self.first = [0.0] * n_layers
        self.bos = [0.0] * n_layers
        self.count = [0] * n_layers
        self.unsupported: set = set()

    @torch.no_grad()
    def add(self, layer: int, attn, x_BTD: torch.Tensor, is_bos_BT: Optional[torch.Tensor] = None,
            executed_BT: Optional[torch.Tensor] = None) -> None:
        if x_BTD.dim() != 3 or x_BTD.shape[1] < 2:
            self.unsupported.add(layer)
            return
        qkv = attention_inputs(attn, x_BTD)
        if qkv is None:
            self.unsupported.add(layer)
            return
        first_BT, bos_BT = first_key_mass(qkv[0], qkv[1], is_bos_BT)
        counted_BT = torch.ones_like(first_BT, dtype=torch.bool)
        counted_BT[:, 0] = False
        if executed_BT is not None:
            counted_BT &= executed_BT
        self.first[layer] += float(first_BT[counted_BT].sum())
        if bos_BT is not None:
            self.bos[layer] += float(bos_BT[counted_BT].sum())
        self.count[layer] += int(counted_BT.sum())

    def report(self) -> dict:
        per_layer = [f / c if c else None for f, c in zip(self.first, self.count)]
        bos = [b / c if c else None for b, c in zip(self.bos, self.count)]
        return sink_summary(per_layer, bos, sorted(self.unsupported))


def sink_summary(per_layer: list, bos_per_layer: Optional[list] = None, unsupported=()) -> dict:
    """Mean first-key mass over layers and the number of layers above 50%."""
    known = [v for v in per_layer if v is not None]
    out = {"first_key_mass_per_layer": per_layer,
           "mean_first_key_mass": sum(known) / len(known) if known else None,
           "layers_above_half": sum(v > 0.5 for v in known),
           "n_layers": len(per_layer),
           "queries": "positions t >= 1 (query 0 sees only key 0); under MoD the executed queries only"}
    if bos_per_layer is not None:
        out["bos_mass_per_layer"] = bos_per_layer
    if unsupported:
        out["unsupported_layers"] = list(unsupported)
    return out
