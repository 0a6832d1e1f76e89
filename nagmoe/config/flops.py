"""Analytic parameter counts and training FLOPs per token.

What is counted (training = forward + backward = 3 x forward; a matmul of an n-vector by an n x m matrix is
2nm forward FLOPs):
- every weight matmul a token pays for: attention q/k/v/o projections, the dense MLP or the *active*
  experts (top_k of them) plus the router, the unembedding (lm_head), and NAG's modulator projection
  (`direction @ weight.T`, C x d per sublayer);
- attention scores and values as the **full T x T matrix** per layer (`QK^T` and `AV`, 2 x 2 x T x n_heads x
  head_dim forward per token, n_heads = the *query* heads), causal or not — nanochat's and
  `torch.utils.flop_counter`'s convention;
- CCA / CCGQA (`model.attention.kind=cca`, reference/cca.md): the latent projections q (d x H·S), k and v
  (d x K·S each) and o (H·S x d), with H = n_heads / q_compression query heads and K = n_heads /
  kv_compression key/value heads of head dim S; the scores run in the latent, 4·H·S·T per token (the S²
  term shrinks with the *query* compression); the two causal convolutions on the C = (H + K)·S channels of
  [q|k] count 2 x their kernel weights per token: depthwise C·k1, grouped per head C·S·k2 (biases are not
  FLOPs). With H·S = d these are the paper's Table II: params 2d²/C1 + 2d²/C2 + conv, forward FLOPs
  (1/C1 + 1/C2)·4d² + 4dT/C1 + conv per token;
- with MoD (`executed`), a skipped token still pays K and V projections (later tokens attend to it) and its
  modulator (the rotation score needs it); the query projection, its score/value rows and the output
  projection of attention, and the whole FFN/MoE (router included), scale with the executed fraction.
  CCA's convolutions and q-k mean need every token's raw q and k latents, so for CCA the q projection and
  the convolutions are paid for every token too; only the scores/values rows and o scale.
Two conventions (`train.flop_convention`; the paper's unit is not public, docs/decisions.md):
- `matmul`: "analytic matmul FLOPs, full T x T attention, no elementwise work" — everything above, the
  unembedding (lm_head) included;
- `non_embedding`: the same without the unembedding (the embedding lookup is no matmul in either), the
  convention of "non-embedding FLOPs" scaling laws. MoD's skipped work is a larger share of it, so a skip rate
  buys more tokens under it.
As executed (`executed_flops_per_token`, what a run's MoD implementation computes, `model.mod.impl`): `gather`
runs attention's executed queries padded to the longest row (B x max rows); `static` computes every token with fixed
shapes and discards the skipped rows, so only the MoE's expert GEMMs scale with the executed fraction: the skipped
rows' attention scores, q (MHA) and o projections, dense FFN and router are still computed
(`static_computed_flops_per_token`). The charged training FLOPs (the budget) are the same for both.
What is not counted: the embedding lookup, elementwise work (norms, NAG centring/projection/normalisation,
RoPE, activations, softmax, residual adds, router top-k, CCA's q-k mean, value shift and temperature), the
loss, and the optimizer step. These are O(d) per token against O(d^2) for the matmuls.
Parameter counts include everything `build_model` creates (CCA: conv kernels *and* biases, and the K
per-kv-head temperatures).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from nagmoe.base.errors import UserError
from nagmoe.config.schema import ModelConfig, attention_heads, eligible_sublayers, expert_hidden

CONVENTIONS = ("matmul", "non_embedding")
PAPER_MOD_TOKEN_RATIO = 60.9 / 50.0  # the paper's MoD 20% run: 60.9B tokens at the FLOPs of 50B full-depth ones


def cca_conv_weights(m: ModelConfig) -> int:
    """Kernel weights of CCA's two causal convolutions over C = (H + K)·S channels: depthwise C·k1, then
    grouped with one group per head (H + K groups of S channels) C·S·k2. 0 without convs or for mha."""
    a = m.attention
    if a.kind != "cca" or not a.use_convs:
        return 0
    n_q, n_kv, hd = attention_heads(m)
    channels = (n_q + n_kv) * hd
    return channels * a.conv_kernel_1 + channels * hd * a.conv_kernel_2


def _attention_params(m: ModelConfig) -> dict[str, int]:
    """Parameters of one attention sublayer by part."""
    if m.attention.kind not in ("mha", "cca"):
        raise UserError(f"model.attention.kind: no accounting for {m.attention.kind!r}")
    n_heads, n_kv, hd = attention_heads(m)
    d = m.d_model
    p = {"q": d * n_heads * hd, "k": d * n_kv * hd, "v": d * n_kv * hd, "o": n_heads * hd * d}
    if m.attention.kind == "cca":
        channels = (n_heads + n_kv) * hd
        p["conv"] = cca_conv_weights(m) + (2 * channels if m.attention.use_convs else 0)  # + both biases
        p["temperature"] = n_kv
    return p


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameter counts of `build_model(m)`; `total` and `active` include embedding and unembedding."""
    d, L, V = m.d_model, m.n_layers, m.vocab_size
    counts = {"embedding": V * d, "unembedding": V * d}
    counts["attention"] = L * sum(_attention_params(m).values())
    counts["dense_mlp"] = counts["router"] = counts["experts"] = counts["experts_active"] = 0
    if m.ffn == "dense":
        counts["dense_mlp"] = L * 2 * d * (m.mlp_hidden or 4 * d)
    else:
        E, k, H = m.moe.n_experts, m.moe.top_k, expert_hidden(m)
        counts["router"] = L * d * E
        counts["experts"] = L * E * 2 * d * H
        counts["experts_active"] = L * k * 2 * d * H
    counts["nag_gates"] = counts["encode_gain"] = counts["mod_base"] = 0
    if m.residual == "nag":
        C = m.nag.C
        counts["nag_gates"] = 2 * L * (C * d + 2 * C + 2)  # weight (C,d), bias, coef, beta_raw, alpha
        counts["encode_gain"] = 1
        if m.mod.skip_rate > 0:
            counts["mod_base"] = 2 * L * d
    shared = (counts["embedding"] + counts["unembedding"] + counts["attention"] + counts["dense_mlp"]
              + counts["router"] + counts["nag_gates"] + counts["encode_gain"] + counts["mod_base"])
    counts["total"] = shared + counts["experts"]
    counts["active"] = shared + counts["experts_active"]
    return counts


Executed = Union[None, float, Sequence[float]]


def _executed_per_sublayer(m: ModelConfig, executed: Executed) -> list[float]:
    n = 2 * m.n_layers
    if executed is None:
        return [1.0] * n
    if isinstance(executed, (int, float)):
        fr = [float(executed)] * n
    else:
        fr = [float(x) for x in executed]
        if len(fr) != n:
            raise UserError(f"executed: expected {n} fractions (one per sublayer), got {len(fr)}")
    for x in fr:
        if not 0.0 <= x <= 1.0:
            raise UserError(f"executed: fraction {x} is not in [0, 1]")
    return fr


def forward_flops_per_token(m: ModelConfig, seq_len: int, executed: Executed = None) -> dict[str, float]:
    """Forward FLOPs per token by part (see the module docstring for the conventions)."""
    fr = _executed_per_sublayer(m, executed)
    d, L, V = m.d_model, m.n_layers, m.vocab_size
    n_heads, _, hd = attention_heads(m)
    ap = _attention_params(m)
    cca = m.attention.kind == "cca"
    # projections every token pays for (MoD: later tokens attend to its K, V; CCA's convs/q-k mean need q0)
    always = ap["k"] + ap["v"] + (ap["q"] if cca else 0)
    executed_only = ap["o"] + (0 if cca else ap["q"])
    conv = cca_conv_weights(m)
    parts = {"attention_proj": 0.0, "attention_conv": 0.0, "attention_scores": 0.0, "ffn": 0.0, "router": 0.0,
             "modulator": 0.0}
    for i in range(L):
        e_att, e_ffn = fr[2 * i], fr[2 * i + 1]
        parts["attention_proj"] += 2 * always + 2 * executed_only * e_att
        parts["attention_conv"] += 2 * conv  # on every token's [q0|k0]
        parts["attention_scores"] += 4 * n_heads * hd * seq_len * e_att  # QK^T and AV, full T x T
        if m.ffn == "dense":
            parts["ffn"] += 2 * 2 * d * (m.mlp_hidden or 4 * d) * e_ffn
        else:
            parts["ffn"] += 2 * m.moe.top_k * 2 * d * expert_hidden(m) * e_ffn
            parts["router"] += 2 * d * m.moe.n_experts * e_ffn
        if m.residual == "nag":
            parts["modulator"] += 2 * 2 * m.nag.C * d  # both sublayers, paid for every token
    parts["unembedding"] = 2.0 * d * V
    parts["total"] = sum(parts.values())
    return parts


def convention_total(parts: dict, convention: str = "matmul") -> float:
    """The total of `forward_flops_per_token`'s parts in a FLOP convention (module docstring)."""
    if convention not in CONVENTIONS:
        raise UserError(f"train.flop_convention: {convention!r} is not one of {', '.join(CONVENTIONS)}")
    return parts["total"] - (parts["unembedding"] if convention == "non_embedding" else 0.0)


def flops_per_token(m: ModelConfig, seq_len: int, executed: Executed = None, convention: str = "matmul") -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token in `convention`; `executed` is the executed
    fraction per sublayer (a scalar for all, or 2 * n_layers values: attention and FFN of each block in order)."""
    return 3.0 * convention_total(forward_flops_per_token(m, seq_len, executed), convention)


def skippable_flops_per_sublayer(m: ModelConfig, seq_len: int) -> list[float]:
    """Per sublayer (attention of block i at 2i, its FFN at 2i+1), the forward FLOPs per token that MoD saves
    when the sublayer skips a token: what the budget stops charging. MoD's work weights (global threshold)."""
    n = 2 * m.n_layers
    full = forward_flops_per_token(m, seq_len)["total"]
    return [full - forward_flops_per_token(m, seq_len, [0.0 if j == i else 1.0 for j in range(n)])["total"]
            for i in range(n)]


def static_computed_flops_per_token(m: ModelConfig, seq_len: int, executed: Executed) -> dict[str, float]:
    """Forward FLOPs per token, by part, that `model.mod.impl: static` computes for skipped tokens beyond what
    `forward_flops_per_token(executed)` charges: the full-depth part minus the charged one for attention (scores for
    every query; the o projection, and MHA's q, for every row), the router (every token is routed) and a dense FFN
    (run on every row); only the MoE's expert GEMMs skip (their grouped GEMM stops at the executed slots)."""
    full, charged = forward_flops_per_token(m, seq_len), forward_flops_per_token(m, seq_len, executed)
    kept = ("attention_scores", "attention_proj", "router") + (("ffn",) if m.ffn == "dense" else ())
    return {k: full[k] - charged[k] for k in kept}


MOD_IMPLS_PRICED = ("gather", "static")  # model.mod.impl as resolved on the run's device (never `auto`)


def executed_flops_per_token(m: ModelConfig, seq_len: int, executed: Executed, padded: Executed,
                             convention: str = "matmul", impl: str = "gather") -> float:
    """Training FLOPs per token as executed by MoD implementation `impl`: like `flops_per_token`, plus what the
    implementation computes beyond the executed tokens. `gather`: attention's score/value rows charged for the
    padded query rows (`padded`: per sublayer, B·max-executed rows per token; the ragged executed queries run
    padded to the longest row) instead of the executed ones. `static`: `static_computed_flops_per_token` (`padded`
    is not read: every query row is computed)."""
    if impl not in MOD_IMPLS_PRICED:
        raise ValueError(f"executed_flops_per_token: impl {impl!r} is not one of {', '.join(MOD_IMPLS_PRICED)}")
    fr = _executed_per_sublayer(m, executed)
    if impl == "static":
        extra = sum(static_computed_flops_per_token(m, seq_len, fr).values())
    else:
        pad = _executed_per_sublayer(m, padded)
        n_heads, _, hd = attention_heads(m)
        extra = sum(4 * n_heads * hd * seq_len * (pad[2 * i] - fr[2 * i]) for i in range(m.n_layers))
    return 3.0 * (convention_total(forward_flops_per_token(m, seq_len, fr), convention) + extra)


def mod_token_ratio(m: ModelConfig, seq_len: int, executed: Executed, convention: str = "matmul") -> float:
    """Ideal tokens under a fixed FLOP budget, relative to full depth: F(executed=1) / F(executed)."""
    return flops_per_token(m, seq_len, 1.0, convention) / flops_per_token(m, seq_len, executed, convention)


def skip_for_token_ratio(m: ModelConfig, seq_len: int, ratio: float, convention: str = "matmul") -> Optional[float]:
    """The skip rate (skipped share of the eligible sublayers' skippable work, model.mod.sublayers) whose ideal
    token ratio is `ratio`: F / (F − s·W) = ratio, so s = F·(1 − 1/ratio) / W with F the full-depth FLOPs per
    token and W the skippable ones. None when even skipping all of W cannot reach it."""
    full = flops_per_token(m, seq_len, 1.0, convention)
    eligible = eligible_sublayers(m.n_layers, m.mod.sublayers)
    skippable = 3.0 * sum(w for w, e in zip(skippable_flops_per_sublayer(m, seq_len), eligible) if e)
    s = full * (1.0 - 1.0 / ratio) / skippable
    return s if s <= 1.0 else None


def mfu(flops_per_second: float, device_name: str, world_size: int = 1) -> Optional[float]:
    """Model FLOPs utilisation against a per-device bf16 dense peak; None (N/A) on unknown hardware."""
    peak = peak_flops(device_name)
    return None if peak is None else flops_per_second / (peak * world_size)


_PEAKS_BF16 = {  # dense bf16 tensor-core peaks from the vendors' data sheets
    "H100 SXM": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12,
    "A100": 312e12, "B200": 2250e12,
}


def peak_flops(device_name: str) -> Optional[float]:
    for key in sorted(_PEAKS_BF16, key=len, reverse=True):
        if key.lower().replace(" ", "") in device_name.lower().replace(" ", "").replace("-", ""):
            return _PEAKS_BF16[key]
    return None
