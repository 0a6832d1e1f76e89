"""Muon's per-matrix kernel: quintic Newton-Schulz orthogonalisation and the shape scale of its update. Shared by
`nagmoe.train.optim.Muon` (one rank) and `nagmoe.parallel.distributed_muon` (the work split over the ranks that
replicate a matrix), so both run the same kernel."""
from __future__ import annotations

from typing import Optional

import torch

# Quintic Newton-Schulz coefficients (a, b, c) for X <- a X + b (X X^T) X + c (X X^T)^2 X. They trade exact
# convergence for speed: after 5 steps every singular value lands in roughly [0.7, 1.2] instead of 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def orthogonalise(g: torch.Tensor, steps: int = NS_STEPS, dtype: Optional[torch.dtype] = None,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of each matrix in `g` (..., rows, cols) by quintic Newton-Schulz iteration.

    Works on the last two dims, leading dims are a batch (each expert of a stack separately). Runs in bf16
    on CUDA and fp32 elsewhere unless `dtype` is given; returns `g.dtype`.
    Normalising by the Frobenius norm first puts every singular value in [0, 1], where the iteration
    p(s) = a s + b s^3 + c s^5 pushes them towards ~1. Iterating on the wide orientation keeps X X^T small.
    """
    if g.ndim < 2:
        raise ValueError(f"orthogonalise needs at least 2 dims, got shape {tuple(g.shape)}")
    if dtype is None:
        dtype = torch.bfloat16 if g.is_cuda else torch.float32
    x = g.float()
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    x = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def muon_shape_scale(shape: torch.Size) -> float:
    """sqrt(max(1, rows / cols)) over the last two dims: an orthogonal update of a tall matrix has a smaller
    RMS, this restores it (rows = fan-out for nn.Linear's (out, in) layout)."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def wide_shape(shape: torch.Size) -> tuple[int, int]:
    """(m, n) with m <= n of the last two dims: the orientation Newton-Schulz iterates on (X X^T is m x m)."""
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if rows > cols else (rows, cols)


def orthogonalise_stack(updates: list[torch.Tensor], steps: int = NS_STEPS,
                        dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """`orthogonalise` of every tensor in `updates` (each (..., r, c), all with the same `wide_shape` (m, n)) as
    ONE batched call: each matrix turned wide (a tall one transposed), all cat into X (G, m, n), the results
    split back and turned back. Per matrix the same maths as `orthogonalise(u)` (a tall u is transposed there
    too); only the batch differs, so a batched matmul may round the last bits differently."""
    flat = [u.reshape(-1, u.size(-2), u.size(-1)) for u in updates]
    oriented = [u.mT if u.size(-2) > u.size(-1) else u for u in flat]
    x_GMN = oriented[0] if len(oriented) == 1 else torch.cat(oriented)
    o_GMN = orthogonalise(x_GMN, steps, dtype)
    out, k = [], 0
    for u, w in zip(updates, oriented):
        o = o_GMN[k:k + w.size(0)]
        k += w.size(0)
        out.append((o.mT if u.size(-2) > u.size(-1) else o).reshape(u.shape))
    return out
