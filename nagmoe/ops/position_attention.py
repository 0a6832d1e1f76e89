"""Causal attention for queries at sorted positions, on the CPU flash kernel without a dense mask (issue 28).

MoD's executed queries sit at arbitrary ascending positions of their sequence and see every key up to their
own position. A position mask over all keys makes the CPU flash kernel read the mask for every score and
compute up to the last query of each block, so MoD's attention cost what full causal attention costs. Here
each sequence is cut into chunks of W positions (W = `POSITION_CHUNK`), and for a query at position p in
chunk c = p // W:
    prefix:  keys [0, c·W)     all visible: one unmasked kernel call per chunk, for every sequence's queries of
                               that chunk (no mask, no wasted keys)
    local:   keys [c·W, p]     inside its own chunk: one batched call over all (sequence, chunk) pairs, W keys
                               each, with a small additive mask
    merge:   lse = logaddexp(l_pre, l_loc);  o = o_pre·exp(l_pre - lse) + o_loc·exp(l_loc - lse)
Backward: each part's flash backward, given the *merged* output and log-sum-exp, yields that part's exact
contribution (P = exp(S - lse), D = rowsum(dO·O)), as in ring attention; the parts' gradients add up.

Legend: B batch, H query heads, M executed query slots per sequence (padded layout), L keys, S head dim,
C chunks, W positions per chunk, R = most executed queries of one sequence in one chunk, N = B·M slots.
K/V arrive with H heads (GQA is repeated by the caller). The math path (`attention_at_positions(impl="math")`)
is the oracle; tests/model/test_position_attention.py holds them equal with gradients.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

POSITION_CHUNK = 256  # positions per chunk: at seq 2048 on CPU, 128 and 512 were both slower

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def chunked_attention_available(q: torch.Tensor) -> bool:
    """The CPU flash kernels exist here and take this dtype."""
    return (_FWD is not None and _BWD is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16))


class _Layout:
    """Where each padded query slot (b, m) goes in the chunk layout (B, C, R): `dest_N` (padding slots go to
    one extra dump row at the end), and each chunk-layout row's position inside its chunk (`relpos_X`)."""

    def __init__(self, positions_BM, valid_BM, rows: int, chunks: int, width: int):
        B, M = positions_BM.shape
        self.B, self.M, self.C, self.R = B, M, chunks, rows
        device = positions_BM.device
        chunk_BM = torch.where(valid_BM, torch.div(positions_BM, width, rounding_mode="floor"), chunks)
        counts_BC = torch.zeros(B, chunks + 1, dtype=torch.long, device=device).scatter_add_(
            1, chunk_BM, torch.ones_like(chunk_BM))
        first_BC = counts_BC.cumsum(1) - counts_BC  # a chunk's first slot in the (ascending) padded row
        rank_BM = torch.arange(M, device=device) - first_BC.gather(1, chunk_BM)
        b_BM = torch.arange(B, device=device).unsqueeze(1)
        self.size = B * chunks * rows
        self.dest_N = torch.where(valid_BM, (b_BM * chunks + chunk_BM) * rows + rank_BM, self.size).reshape(-1)
        relpos_BM = positions_BM - chunk_BM * width
        self.relpos_X = torch.zeros(self.size + 1, dtype=torch.long, device=device).index_copy_(
            0, self.dest_N, relpos_BM.reshape(-1))[:-1]

    def to_chunks(self, x_BHMS: torch.Tensor) -> torch.Tensor:
        """(B, H, M, ...) -> (B, C, H, R, ...), zeros in unused rows."""
        H, tail = x_BHMS.shape[1], x_BHMS.shape[3:]
        rows_N = x_BHMS.transpose(1, 2).reshape(-1, H, *tail)
        out = rows_N.new_zeros(self.size + 1, H, *tail).index_copy_(0, self.dest_N, rows_N)[:-1]
        return out.view(self.B, self.C, self.R, H, *tail).transpose(2, 3).contiguous()

    def from_chunks(self, x_BCHR_: torch.Tensor) -> torch.Tensor:
        """(B, C, H, R, ...) -> (B, H, M, ...), zeros on padding slots."""
        H, tail = x_BCHR_.shape[2], x_BCHR_.shape[4:]
        rows = x_BCHR_.transpose(2, 3).reshape(self.size, H, *tail)
        rows = torch.cat([rows, rows.new_zeros(1, H, *tail)])
        return rows.index_select(0, self.dest_N).view(self.B, self.M, H, *tail).transpose(1, 2)


def _merge(o_a, l_a, o_b, l_b):
    """Two softmax partial results over disjoint key sets -> the one over their union."""
    lse = torch.logaddexp(l_a, l_b)
    o = o_a * (l_a - lse).exp().unsqueeze(-1).to(o_a.dtype) + o_b * (l_b - lse).exp().unsqueeze(-1).to(o_b.dtype)
    return o, lse


class _ChunkedPositionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHMS, k_BHLS, v_BHLS, positions_BM, valid_BM, chunk_rows, width):
        B, H, _, S = q_BHMS.shape
        L = k_BHLS.shape[2]
        C, R = len(chunk_rows), max(max(chunk_rows), 1)
        scale = 1.0 / math.sqrt(S)
        layout = _Layout(positions_BM, valid_BM, R, C, width)
        q_X = layout.to_chunks(q_BHMS)  # (B, C, H, R, S)

        def by_chunk(t_BHLS):  # (B, H, L, S) -> (B·C, H, W, S), zero keys past L (masked below)
            t = F.pad(t_BHLS, (0, 0, 0, C * width - L))
            return t.view(B, H, C, width, S).transpose(1, 2).reshape(B * C, H, width, S)

        k_loc, v_loc = by_chunk(k_BHLS), by_chunk(v_BHLS)
        visible = torch.arange(width, device=q_BHMS.device) <= layout.relpos_X.view(B * C, 1, R, 1)
        mask = torch.zeros(visible.shape, dtype=q_BHMS.dtype, device=q_BHMS.device).masked_fill_(
            ~visible, float("-inf"))
        o_loc, l_loc = _FWD(q_X.view(B * C, H, R, S), k_loc, v_loc, 0.0, False, attn_mask=mask, scale=scale)
        o_X, l_X = o_loc.view(B, C, H, R, S), l_loc.view(B, C, H, R).float()
        for c in range(1, C):  # the prefix of chunk c: keys [0, c·W), all visible
            r = chunk_rows[c]
            if r == 0:
                continue
            o_pre, l_pre = _FWD(q_X[:, c, :, :r], k_BHLS[:, :, :c * width], v_BHLS[:, :, :c * width], 0.0,
                                False, scale=scale)
            o_X[:, c, :, :r], l_X[:, c, :, :r] = _merge(o_pre, l_pre.float(), o_X[:, c, :, :r], l_X[:, c, :, :r])
        ctx.save_for_backward(q_X, k_BHLS, v_BHLS, k_loc, v_loc, mask, o_X, l_X)
        ctx.layout, ctx.meta = layout, (L, width, tuple(chunk_rows), scale)
        return layout.from_chunks(o_X)

    @staticmethod
    def backward(ctx, grad_BHMS):
        q_X, k_BHLS, v_BHLS, k_loc, v_loc, mask, o_X, l_X = ctx.saved_tensors
        L, width, chunk_rows, scale = ctx.meta
        B, C, H, R, S = q_X.shape
        dout_X = ctx.layout.to_chunks(grad_BHMS.contiguous())
        dq_loc, dk_loc, dv_loc = _BWD(dout_X.view(B * C, H, R, S), q_X.view(B * C, H, R, S), k_loc, v_loc,
                                      o_X.view(B * C, H, R, S), l_X.view(B * C, H, R), 0.0, False,
                                      attn_mask=mask, scale=scale)
        dq_X = dq_loc.view(B, C, H, R, S)

        def from_chunk_keys(t):  # (B·C, H, W, S) -> (B, H, L, S)
            return t.view(B, C, H, width, S).transpose(1, 2).reshape(B, H, C * width, S)[:, :, :L]

        dk, dv = from_chunk_keys(dk_loc).contiguous(), from_chunk_keys(dv_loc).contiguous()
        for c in range(1, C):
            r = chunk_rows[c]
            if r == 0:
                continue
            keys = c * width
            dq, dk_c, dv_c = _BWD(dout_X[:, c, :, :r], q_X[:, c, :, :r], k_BHLS[:, :, :keys], v_BHLS[:, :, :keys],
                                  o_X[:, c, :, :r], l_X[:, c, :, :r], 0.0, False, scale=scale)
            dq_X[:, c, :, :r] += dq
            dk[:, :, :keys] += dk_c
            dv[:, :, :keys] += dv_c
        return ctx.layout.from_chunks(dq_X), dk, dv, None, None, None, None


def chunked_position_attention(q_BHMS: torch.Tensor, k_BHLS: torch.Tensor, v_BHLS: torch.Tensor,
                               positions_BM: torch.Tensor, valid_BM: torch.Tensor, chunk_rows: Sequence[int],
                               width: int = POSITION_CHUNK) -> torch.Tensor:
    """softmax(q kᵀ/sqrt(S), key <= position) v for the valid slots of the padded layout (padding slots: 0).
    `chunk_rows[c]`: the most valid queries any one sequence has in positions [c·W, (c+1)·W), for every
    chunk that covers the L keys (MoD's ExecutedTokens reads them with its counts: no host read here)."""
    if -(-k_BHLS.shape[2] // width) != len(chunk_rows):
        raise ValueError(f"chunked_position_attention: {len(chunk_rows)} chunk counts for {k_BHLS.shape[2]} keys "
                         f"in chunks of {width}")
    return _ChunkedPositionAttention.apply(q_BHMS.contiguous(), k_BHLS.contiguous(), v_BHLS.contiguous(),
                                           positions_BM, valid_BM, list(chunk_rows), width)
