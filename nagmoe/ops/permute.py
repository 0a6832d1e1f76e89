"""Row gathers whose backward is a gather too: the MoE's slot permutation both ways (nagmoe/model/moe.py).

`x[order]` by advanced indexing has for backward `zeros_like(x).index_put_(order, grad, accumulate=True)`: a
zero-filled buffer and a scatter (atomics on CUDA) although each row receives exactly one gradient. For a
permutation the transpose of a gather by `order` is a gather by its inverse `inv` (inv[order[r]] = r):

    y = permute_rows(x, order, inv)      y[r] = x[order[r]]          grad_x[m] = grad_y[inv[m]]

Deterministic, no buffer to zero, the same values (a copy either way; -0.0 may stay -0.0 where the scatter's
0 + g made it +0.0, equal under ==). Two generalisations the MoE needs, each the exact transpose of the other:
  repeat = K  the source is x_ND seen as N·K rows, row s = x[s // K] (the K routing slots of a token): the
              forward gathers x[order // K], the backward gathers by `inv` into (N·K, D) and sums over K,
              x.grad[n] = Σ_k g[n·K + k], as the expand's backward it replaces (same reduction, same order).
  partial     with a capacity only R of the S slots are kept: `inv` holds R for a dropped slot, meaning "no
              row": the gather reads a zero row appended to the R (one row, not an (S, D) zero buffer).
No host read, static shapes: `inv` is computed once per layer call on the device (`inverse_permutation`).
"""
from __future__ import annotations

from typing import Optional

import torch


def inverse_permutation(order_S: torch.Tensor) -> torch.Tensor:
    """inv with inv[order[s]] = s, on the device (a scatter of integers, no gradient)."""
    return torch.empty_like(order_S).scatter_(0, order_S, torch.arange(order_S.numel(), device=order_S.device))


def _gather(x_MD: torch.Tensor, index_R: torch.Tensor, pad: bool) -> torch.Tensor:
    if pad:  # index M means "no row": a zero row appended
        x_MD = torch.cat([x_MD, x_MD.new_zeros(1, x_MD.shape[1])])
    return x_MD.index_select(0, index_R)


class _PermuteRows(torch.autograd.Function):
    """y = gather(x, fwd_index) (optionally padded); grad_x = gather(grad_y, bwd_index) (optionally padded),
    summed over groups of `repeat` rows."""

    @staticmethod
    def forward(ctx, x_MD, fwd_R, bwd_M, repeat: int, pad_fwd: bool, pad_bwd: bool):
        ctx.save_for_backward(fwd_R, bwd_M)
        ctx.repeat, ctx.pad_fwd, ctx.pad_bwd = repeat, pad_fwd, pad_bwd
        return _gather(x_MD, fwd_R, pad_fwd)

    @staticmethod
    def backward(ctx, grad_RD):
        fwd_R, bwd_M = ctx.saved_tensors
        g_MD = _gather(grad_RD.contiguous(), bwd_M, ctx.pad_bwd)
        if ctx.repeat > 1:
            g_MD = g_MD.view(-1, ctx.repeat, g_MD.shape[1]).sum(1)
        return g_MD, None, None, None, None, None


def permute_rows(x_MD: torch.Tensor, order_R: torch.Tensor, inverse_M: torch.Tensor, repeat: int = 1,
                 partial: Optional[str] = None) -> torch.Tensor:
    """y[r] = x'[order[r]] where x' is x with each row repeated `repeat` times (x'[m] = x[m // repeat]); the
    backward gathers by `inverse` (inverse[order[r]] = r) and sums the repeats. `partial`: "out" when `order`
    picks R < M' rows of x' (the backward reads row R, a zero, for the rows never picked, as `inverse` says);
    "in" when x has R rows and `order` holds R for the output rows that get none (a zero)."""
    if partial not in (None, "in", "out"):
        raise ValueError(f"permute_rows: partial={partial!r}")
    fwd_R = order_R // repeat if repeat > 1 else order_R
    return _PermuteRows.apply(x_MD, fwd_R, inverse_M, repeat, partial == "in", partial == "out")
