"""Attention sublayers, chosen by `model.attention.kind` through a small registry.

Legend: B batch, T sequence (the new tokens when decoding), L key positions (cached + new), D model width,
H query heads, K key/value heads (GQA: H % K == 0), S head dim, R rotary dims (the leading R of S;
rope_fraction < 1 leaves the rest unrotated).

Every attention module is built as `Cls(d_model, attn_cfg, init_std=None)` and called as
`forward(x_BTD, cache=None) -> (y_BTD, None)`, the same call shape as the FFN sublayers. The score
computation is picked by `model.attention.impl` through `nagmoe.ops.registry`: `sdpa`
(F.scaled_dot_product_attention, the default) or `math` (explicit matmuls with a causal mask: the reference
and the FLOP-counter's target).

Incremental decoding: with an `AttentionCache`, `forward` treats x_BTD as the T tokens that follow the
`cache.length` tokens already seen (RoPE positions start there), appends its keys/values (and, for CCA, its
conv and value-shift state) to the cache, and attends over everything cached. Inference only (no autograd).

Mixture-of-Depths (`select`, a `nagmoe.model.mod.ExecutedTokens`): keys and values are computed for every
token (later tokens attend to skipped ones; the cache is unchanged), queries, score rows and the output
projection only for the executed tokens. Those run in a padded per-sequence layout (B, M) at their original
positions, masked by `key <= position` (`attention_at_positions`; `is_causal` would align a shorter query set
wrongly); `forward` then returns `(y_ND, None)` for the N executed tokens (flat, row-major). A static
`Selection` (model.mod.impl=static) runs the causal path over every query, `(y_BTD, None)`: exact for the
executed rows, which are all the stream keeps.
"""
from __future__ import annotations

import importlib
import math
from typing import Callable, Optional

import torch
import torch.nn.attention
import torch.nn.functional as F
from torch import nn

from nagmoe.base.errors import UserError
from nagmoe.model.common import init_linear_uniform, recording, rms_norm
from nagmoe.model.init_rng import ParamInit
from nagmoe.model.mod import Selection, decide
from nagmoe.ops.position_attention import chunked_attention_available, chunked_position_attention
from nagmoe.ops.registry import Registry

# The position-blocked SDPA calls (MoD's executed queries, `attention_at_positions`) have data-dependent key
# lengths and masks: cuDNN attention builds and caches an execution plan per exact shape (forward and backward,
# never evicted), so there it would plan almost every call. Those calls never use cuDNN, and their key lengths
# round up to a multiple of KEY_ROUNDING (the mask hides the extra keys), so the set of shapes is finite.
KEY_ROUNDING = 256


# The SDPA kernels the position-blocked calls may use: every one but cuDNN (torch.nn.attention.SDPBackend).
POSITION_SDPA_BACKENDS = [torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                          torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]

def _flash_available() -> bool:
    """flash-attn (optional `gpu` extra): CUDA only, and only when the package imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


ATTENTION_IMPL = Registry("attention", reference="math")
ATTENTION_IMPL.register("sdpa")  # first: what `auto` resolves to
ATTENTION_IMPL.register("math")
ATTENTION_IMPL.register("flash", available=_flash_available)  # only when asked for (after sdpa for `auto`)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def flash_inputs(q_BHTS, k_BKLS, v_BKLS) -> Optional[tuple]:
    """q, k, v cast together to one low-precision dtype for flash-attn (fp16/bf16 only), or None: fp32 inputs
    outside autocast take SDPA. Checking q alone is not enough: under CUDA's autocast from torch 2.12 `rms_norm`
    is fp32, so CCA's and QK-norm's q and k leave it fp32 while v is bf16. The dtype: autocast's when it is on,
    else the low-precision dtype one of them already has."""
    device = q_BHTS.device.type
    if torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
    else:
        low = next((t.dtype for t in (q_BHTS, k_BKLS, v_BKLS) if t.dtype in LOW_PRECISION), None)
    if low not in LOW_PRECISION:
        return None
    return tuple(t.to(low) for t in (q_BHTS, k_BKLS, v_BKLS))


def _flash_causal(q_BHTS, k_BKLS, v_BKLS):
    """flash-attn's kernel: (B, T, H, S) layout, GQA natively, causal mask aligned bottom-right (so a KV-cache
    offset is the same mask as ours); q, k and v in one of fp16/bf16 (`flash_inputs`)."""
    from flash_attn import flash_attn_func

    dtypes = {q_BHTS.dtype, k_BKLS.dtype, v_BKLS.dtype}
    if len(dtypes) != 1 or not dtypes <= set(LOW_PRECISION):
        raise RuntimeError(f"flash-attn needs q, k, v in one of fp16/bf16, got {sorted(map(str, dtypes))}")

    out_BTHS = flash_attn_func(q_BHTS.transpose(1, 2), k_BKLS.transpose(1, 2), v_BKLS.transpose(1, 2),
                               causal=True)
    return out_BTHS.transpose(1, 2)


def resolve_attention_impl(requested: str) -> str:
    try:
        return ATTENTION_IMPL.resolve(requested)
    except ValueError:
        raise UserError(f"model.attention.impl: {requested!r} is not available "
                        f"(known here: auto, {', '.join(ATTENTION_IMPL.names())})") from None


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding and the score computation
# ----------------------------------------------------------------------------------------------------------
def rotary_dims(head_dim: int, rope_fraction: float) -> int:
    """Rotary dims R: the largest even number <= rope_fraction * head_dim."""
    return int(head_dim * rope_fraction) // 2 * 2


def rope_tables(seq_len: int, rot_dims: int, base: float, device, offset: int = 0):
    """cos, sin of shape (T, R/2), fp32: angle(t, i) = (t + offset) * base^(-2i/R). Computed per call (cheap)
    so the module has no buffers to move, cast or re-initialise."""
    inv_freq = base ** (-torch.arange(0, rot_dims, 2, device=device, dtype=torch.float32) / rot_dims)
    pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x_BTHS: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the leading R dims of each head in pairs (first half, second half), fp32 math:
    (x1, x2) -> (x1·cos + x2·sin, -x1·sin + x2·cos); dims beyond R pass through. The tables are (T, R/2),
    or (B, T, R/2) for per-sequence positions (MoD's executed queries)."""
    half = cos_TR.shape[-1]
    if half == 0:
        return x_BTHS
    rot, rest = x_BTHS[..., : 2 * half].float(), x_BTHS[..., 2 * half:]
    x1, x2 = rot[..., :half], rot[..., half:]
    if cos_TR.dim() == 2:
        cos, sin = cos_TR[None, :, None, :], sin_TR[None, :, None, :]
    else:
        cos, sin = cos_TR[:, :, None, :], sin_TR[:, :, None, :]
    rotated = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(x_BTHS.dtype)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated


_SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # torch's SDPBackend


def sdpa_kernel(q, k, v, attn_mask=None, is_causal: bool = False, enable_gqa: bool = False) -> str:
    """The kernel F.scaled_dot_product_attention picks for this call (torch's own choice function: a host-side
    decision on dtypes, shapes, mask and the enabled backends; no device sync). Eager calls only: inside a
    compiled graph nothing is recorded (nagmoe.model.common.recording) and the choice is the compiler's."""
    try:
        choice = int(torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=None, enable_gqa=enable_gqa))
    except (RuntimeError, TypeError, AttributeError):
        return "unknown"
    name = _SDPA_KERNELS.get(choice, str(choice))
    return name + ("_for_cpu" if name == "flash" and q.device.type == "cpu" else "")


def causal_attention(q_BHTS: torch.Tensor, k_BKLS: torch.Tensor, v_BKLS: torch.Tensor, impl: str,
                     q_offset: int = 0, ran: Optional[dict] = None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(S) + causal mask) v, with K <= H key/value heads shared by H/K query heads each
    (query head h reads key/value head h // (H/K)).

    The L = q_offset + T keys cover the T queries' own positions and the q_offset positions before them
    (a KV cache): query i (absolute position q_offset + i) sees keys j <= q_offset + i. `ran` (a module's
    record) gets the kernel that ran: `flash-attn`, `sdpa:<SDPA's kernel>` or `math`."""
    n_rep = q_BHTS.shape[1] // k_BKLS.shape[1]
    T, L = q_BHTS.shape[2], k_BKLS.shape[2]
    ran = recording(ran)
    if L != q_offset + T:
        raise ValueError(f"causal_attention: {L} keys for {T} queries at offset {q_offset}")
    qkv = flash_inputs(q_BHTS, k_BKLS, v_BKLS) if impl == "flash" else None
    if qkv is not None:
        if ran is not None:
            ran["attention"] = "flash-attn"
        return _flash_causal(*qkv)
    if impl in ("sdpa", "flash"):
        causal = q_offset == 0  # square: SDPA's own causal mask; a new token alone sees everything
        mask_TL = None if causal or T == 1 else _visible_TL(T, q_offset, q_BHTS.device)
        if ran is not None:
            ran["attention"] = ("sdpa (flash-attn needs fp16/bf16): " if impl == "flash" else "sdpa:") + \
                sdpa_kernel(q_BHTS, k_BKLS, v_BKLS, mask_TL, causal, n_rep > 1)
        return F.scaled_dot_product_attention(q_BHTS, k_BKLS, v_BKLS, attn_mask=mask_TL, is_causal=causal,
                                              enable_gqa=n_rep > 1)
    if ran is not None:
        ran["attention"] = "math"
    # math: the explicit reference (softmax in fp32)
    k_BHLS = k_BKLS.repeat_interleave(n_rep, dim=1)
    v_BHLS = v_BKLS.repeat_interleave(n_rep, dim=1)
    scores_BHTL = (q_BHTS @ k_BHLS.transpose(-2, -1)).float() / math.sqrt(q_BHTS.shape[-1])
    scores_BHTL = scores_BHTL.masked_fill(~_visible_TL(T, q_offset, q_BHTS.device), float("-inf"))
    probs_BHTL = torch.softmax(scores_BHTL, dim=-1).to(v_BHLS.dtype)
    return probs_BHTL @ v_BHLS


def attention_at_positions(q_BHMS: torch.Tensor, k_BKLS: torch.Tensor, v_BKLS: torch.Tensor, impl: str,
                           positions_BM: torch.Tensor, max_blocks: int = 8, min_block: int = 256,
                           key_ends: Optional[list] = None, chunks: Optional[tuple] = None,
                           ran: Optional[dict] = None) -> torch.Tensor:
    """Causal attention for queries at arbitrary absolute positions (MoD's executed queries, padded per
    sequence): query m of sequence b sees keys j <= positions_BM[b, m]. The mask comes from the original
    positions, so only B·M score rows are computed (`math` really computes only those, full key length: the
    FLOP counter sees the saving under the full-matrix convention). Padding slots need a position >= 0 (0 is
    best: they see key 0, no empty softmax row, and do not lengthen a block).

    `sdpa` with an explicit mask cannot skip the masked upper triangle as `is_causal` does, which would make
    the executed queries cost more wall-clock than the full causal attention. Queries ascend in position, so
    they run in at most `max_blocks` blocks (>= `min_block` queries each), each against only the keys up to
    its last query's position: the skipped work is that of causal attention up to one block per row. Each
    block's K/V slice costs a gradient copy, so short sequences run one block (measured on CPU, T = 256:
    causal and unmasked SDPA cost the same, 4 blocks of 64 queries 12% more than one call, 16 blocks 90%).

    On CPU, with `chunks` = (valid_BM, chunk_rows, chunk) from MoD's ExecutedTokens (`position_chunks`) and
    more than one chunk, sdpa runs instead the chunked flash kernel of nagmoe/ops/position_attention.py:
    unmasked prefix calls plus one small masked call inside each chunk, merged by log-sum-exp (no dense mask, no
    key past a query's chunk); within one chunk the single masked block is the same work, with less layout."""
    ran = recording(ran)
    n_rep = q_BHMS.shape[1] // k_BKLS.shape[1]
    M, L = q_BHMS.shape[2], k_BKLS.shape[2]
    if impl == "sdpa" and M > 0 and chunks is not None and len(chunks[1]) > 1 and chunked_attention_available(q_BHMS):
        valid_BM, chunk_rows, chunk = chunks
        k_BHLS = k_BKLS.repeat_interleave(n_rep, dim=1) if n_rep > 1 else k_BKLS
        v_BHLS = v_BKLS.repeat_interleave(n_rep, dim=1) if n_rep > 1 else v_BKLS
        if ran is not None:
            ran["attention_at_positions"] = "chunked position kernel (nagmoe/ops/position_attention.py)"
        return chunked_position_attention(q_BHMS, k_BHLS, v_BHLS, positions_BM, valid_BM, chunk_rows, chunk)
    if impl in ("sdpa", "flash") and M > 0:  # flash: no position-masked kernel, SDPA runs it (no queries: the math path below keeps the empty graph connected)
        size = max(min_block, -(-M // max_blocks))
        # keys any query up to slot m may see: running max over m of the batch's positions + 1 (MoD's
        # ExecutedTokens read them with its counts: `key_ends`, no second host read)
        if key_ends is None:
            key_ends = (positions_BM.amax(0).cummax(0).values + 1).tolist()
        ends = [min(-(-e // KEY_ROUNDING) * KEY_ROUNDING, L) for e in key_ends]  # finitely many shapes
        outs = []
        with torch.nn.attention.sdpa_kernel(POSITION_SDPA_BACKENDS):  # never cuDNN (KEY_ROUNDING)
            for start in range(0, M, size):
                stop = min(M, start + size)
                keys = ends[stop - 1]
                visible_B1mL = (torch.arange(keys, device=q_BHMS.device)
                                <= positions_BM[:, start:stop].unsqueeze(-1)).unsqueeze(1)
                q_part, k_part, v_part = q_BHMS[:, :, start:stop], k_BKLS[:, :, :keys], v_BKLS[:, :, :keys]
                if ran is not None and start == 0:  # every block has the same dtypes and kind of mask
                    ran["attention_at_positions"] = "sdpa blocks:" + sdpa_kernel(q_part, k_part, v_part,
                                                                                  visible_B1mL, False, n_rep > 1)
                outs.append(F.scaled_dot_product_attention(q_part, k_part, v_part, attn_mask=visible_B1mL,
                                                           enable_gqa=n_rep > 1))
        return torch.cat(outs, dim=2) if len(outs) != 1 else outs[0]
    if ran is not None:
        ran["attention_at_positions"] = "math"
    visible_B1ML = (torch.arange(L, device=q_BHMS.device) <= positions_BM.unsqueeze(-1)).unsqueeze(1)
    k_BHLS = k_BKLS.repeat_interleave(n_rep, dim=1)
    v_BHLS = v_BKLS.repeat_interleave(n_rep, dim=1)
    scores_BHML = (q_BHMS @ k_BHLS.transpose(-2, -1)).float() / math.sqrt(q_BHMS.shape[-1])
    scores_BHML = scores_BHML.masked_fill(~visible_B1ML, float("-inf"))
    probs_BHML = torch.softmax(scores_BHML, dim=-1).to(v_BHLS.dtype)
    return probs_BHML @ v_BHLS


def executed_queries(q_BMHS: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, select, offset: int):
    """The executed queries, already in the padded per-sequence layout (`select.to_padded` of flat rows, or
    `select.gather_padded` of every token's), with RoPE at their original positions: returns
    (q_BMHS, positions_BM absolute). Padding rows are dropped by `select.from_padded`."""
    positions_BM, _ = select.padded()
    return apply_rope(q_BMHS, cos_TR[positions_BM], sin_TR[positions_BM]), positions_BM + offset


def _visible_TL(T: int, q_offset: int, device) -> torch.Tensor:
    """Boolean (T, q_offset + T): True where query i may see key j, i.e. j <= q_offset + i."""
    return torch.ones(T, q_offset + T, dtype=torch.bool, device=device).tril(q_offset)


# ----------------------------------------------------------------------------------------------------------
# Inference state of one attention sublayer
# ----------------------------------------------------------------------------------------------------------
class AttentionCache:
    """Decoding state of one attention sublayer for a batch of B sequences (filled under no_grad).

    `k_BKLS`, `v_BKLS`: keys (post-norm, post-RoPE: exactly what the scores use) and values of the `length`
    positions seen so far, in buffers allocated on first use for `max_len` positions. CCA also keeps
    `conv_BCW` (the raw pre-conv [q0|k0] latents of the last W tokens) and `shift_BC` (the shifted value
    half's projection of the last token); MHA leaves them None.
    """

    def __init__(self, max_len: int):
        if max_len < 1:
            raise ValueError(f"AttentionCache: max_len {max_len} must be >= 1")
        self.max_len = max_len
        self.length = 0
        self.k_BKLS: Optional[torch.Tensor] = None
        self.v_BKLS: Optional[torch.Tensor] = None
        self.conv_BCW: Optional[torch.Tensor] = None
        self.shift_BC: Optional[torch.Tensor] = None

    def append(self, k_BKTS: torch.Tensor, v_BKTS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the T new positions; return keys and values of all `length` positions (views)."""
        start, end = self.length, self.length + k_BKTS.shape[2]
        if end > self.max_len:
            raise ValueError(f"AttentionCache: {end} positions exceed max_len {self.max_len}")
        if self.k_BKLS is None:
            B, K, _, S = k_BKTS.shape
            self.k_BKLS = k_BKTS.new_zeros(B, K, self.max_len, S)
            self.v_BKLS = v_BKTS.new_zeros(B, K, self.max_len, v_BKTS.shape[-1])
        self.k_BKLS[:, :, start:end] = k_BKTS
        self.v_BKLS[:, :, start:end] = v_BKTS
        self.length = end
        return self.k_BKLS[:, :, :end], self.v_BKLS[:, :, :end]

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per cached token and sequence (the part that grows with the context)."""
        if self.k_BKLS is None:
            return 0
        per_seq = self.k_BKLS[0, :, 0].numel() * self.k_BKLS.element_size() \
            + self.v_BKLS[0, :, 0].numel() * self.v_BKLS.element_size()
        return int(per_seq)

    def state_bytes(self) -> int:
        """Bytes per sequence of the fixed-size state (CCA's conv and value-shift state)."""
        total = 0
        for t in (self.conv_BCW, self.shift_BC):
            if t is not None:
                total += t[0].numel() * t.element_size()
        return total


# ----------------------------------------------------------------------------------------------------------
# Multi-head / grouped-query attention
# ----------------------------------------------------------------------------------------------------------
class MultiHeadAttention(nn.Module):
    """MHA/GQA: c_q, c_k, c_v, c_proj (zero-init), no biases; RoPE on q and k; parameter-free QK RMS-norm."""

    def __init__(self, d_model: int, attn_cfg, init_std: Optional[float] = None):
        super().__init__()
        self.n_heads = attn_cfg.n_heads
        self.n_kv_heads = attn_cfg.n_kv_heads or attn_cfg.n_heads
        self.head_dim = attn_cfg.head_dim or d_model // attn_cfg.n_heads
        self.qk_norm = attn_cfg.qk_norm
        self.rope_base = attn_cfg.rope_base
        self.rot_dims = rotary_dims(self.head_dim, attn_cfg.rope_fraction)
        self.impl = resolve_attention_impl(attn_cfg.impl)
        self.ran: dict[str, str] = {}  # the kernels the last call ran (nagmoe.train.backends_ran), no sync
        self.init_std = init_std if init_std is not None else d_model ** -0.5
        self.c_q = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.c_k = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.c_v = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weights(ParamInit())

    def init_weights(self, init: ParamInit) -> None:
        for lin in ("c_q", "c_k", "c_v"):
            init_linear_uniform(self, lin, self.init_std, init)
        init.zeros_(self, "c_proj.weight")

    def forward(self, x_BTD: torch.Tensor, cache: Optional[AttentionCache] = None, select=None):
        """`(y_BTD, None)`; with `select` (MoD) `(y_ND, None)` for the executed tokens only (module docstring)."""
        select = decide(select)  # static MoD: the decision inside this sublayer's compiled unit
        B, T, _ = x_BTD.shape
        H, K, S = self.n_heads, self.n_kv_heads, self.head_dim
        offset = cache.length if cache is not None else 0
        k_BTKS = self.c_k(x_BTD).view(B, T, K, S)
        v_BTKS = self.c_v(x_BTD).view(B, T, K, S)
        cos, sin = rope_tables(T, self.rot_dims, self.rope_base, x_BTD.device, offset=offset)
        k_BTKS = apply_rope(k_BTKS, cos, sin)
        if self.qk_norm:
            k_BTKS = rms_norm(k_BTKS)
        k_BKLS, v_BKLS = k_BTKS.transpose(1, 2), v_BTKS.transpose(1, 2)
        if cache is not None:
            k_BKLS, v_BKLS = cache.append(k_BKLS, v_BKLS)
        if select is None or isinstance(select, Selection):  # static MoD: every query; the stream keeps its rows
            q_BTHS = apply_rope(self.c_q(x_BTD).view(B, T, H, S), cos, sin)
            if self.qk_norm:
                q_BTHS = rms_norm(q_BTHS)
            y_BHTS = causal_attention(q_BTHS.transpose(1, 2), k_BKLS, v_BKLS, self.impl, q_offset=offset,
                                      ran=self.ran)
            return self.c_proj(y_BHTS.transpose(1, 2).reshape(B, T, H * S)), None
        # MoD: the query projection, score rows and output projection of the executed tokens only
        q_NHS = self.c_q(select.gather(x_BTD)).view(-1, H, S)
        q_BMHS, positions_BM = executed_queries(select.to_padded(q_NHS), cos, sin, select, offset)
        if self.qk_norm:
            q_BMHS = rms_norm(q_BMHS)
        y_BHMS = attention_at_positions(q_BMHS.transpose(1, 2), k_BKLS, v_BKLS, self.impl, positions_BM,
                                        key_ends=select.key_ends_at(offset), chunks=select.position_chunks(offset),
                                        ran=self.ran)
        y_NHS = select.from_padded(y_BHMS.transpose(1, 2))
        return self.c_proj(y_NHS.reshape(-1, H * S)), None


# ----------------------------------------------------------------------------------------------------------
# Registry: kind -> class. Kinds implemented in other modules are imported when first asked for.
# ----------------------------------------------------------------------------------------------------------
ATTENTION_KINDS: dict[str, Callable[..., nn.Module]] = {"mha": MultiHeadAttention}
_LAZY_KINDS = {"cca": ("nagmoe.model.cca", "CCAttention")}


def register_attention(kind: str, cls: Callable[..., nn.Module]) -> None:
    ATTENTION_KINDS[kind] = cls


def build_attention(d_model: int, attn_cfg, init_std: Optional[float] = None) -> nn.Module:
    kind = attn_cfg.kind
    if kind not in ATTENTION_KINDS and kind in _LAZY_KINDS:
        module_name, cls_name = _LAZY_KINDS[kind]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            raise UserError(f"model.attention.kind: {kind!r} is not implemented yet") from None
        ATTENTION_KINDS[kind] = getattr(module, cls_name)
    if kind not in ATTENTION_KINDS:
        raise UserError(f"model.attention.kind: {kind!r} is not one of {', '.join(ATTENTION_KINDS)}")
    return ATTENTION_KINDS[kind](d_model, attn_cfg, init_std=init_std)
