"""Mixture-of-Depths from the NAG geometry (reference/nag.md, "Mixture-of-Depths from the geometry").

Legend: B batch, T sequence (the new tokens when decoding), D model width, N executed tokens of the batch
(flat, row-major over (B, T)), M = the most executed tokens of one sequence (padded layout), n sublayers,
K histogram bins.

Per NAG sublayer l, before it runs, every token has a rotation score r = arctan(α·m) / arctan(α) ∈ [0, 1]
(nag.rotation_score): the rotation the sublayer would apply as a fraction of its ceiling. Tokens with
r > p_l (the sublayer's threshold) execute F; the others do not. A learned base vector X_l is added for
every token (f̂ = F(R̄) + X_l executed, f̂ = X_l skipped), then the NAG update with scale α·m·warmup.

Thresholds (`MoDCalibrator`, nagmoe/model/mod_calibration.py): causal histograms of earlier steps' scores, in
three modes (`model.mod.threshold`: one global threshold on the score, the default; one quantile per sublayer;
a fixed p_thres). Skipping starts once `max(model.mod.start_tokens, model.nag.warmup_tokens)` tokens have been
seen; before that every token executes but the histograms calibrate.

Batching (`ExecutedTokens`): FFN/MoE run on a flat `(N, D)` gather of the executed tokens; attention keeps
K and V for every token and runs its executed queries in a padded per-sequence layout `(B, M)` with their
original positions (`key <= position`; on CPU the chunked kernel of nagmoe/ops/position_attention.py), so the
score work is about B·M·L/2 instead of B·T·L/2.

Two implementations of the same function (`model.mod.impl`, `resolve_mod_impl`):
  gather  the above: the executed tokens gathered (one host read per sublayer for the counts and key ends);
          the FLOP saving is realised on the CPU (0.95 of it, docs/benchmarks.md), but every step has new
          shapes: a GPU pays a recompile, a kernel plan or a host sync for them.
  static  a `Selection` (the executed mask on the device, the skip flag applied there: mask = (r > p) | not
          skipping) and sublayers that compute every token with fixed shapes: attention runs the causal path
          over all queries (the skipped rows are discarded: exact), the MoE routes every token but gives expert
          slots to the executed ones only (grouped GEMM offsets stop at them, nagmoe/model/moe.py), the stream
          keeps the executed rows with torch.where. No host read, the same graph before and after skipping
          starts and whatever the counts: what a GPU needs (torch.compile, CUDA graphs), at the price of the
          attention's and dense FFN's skipped rows (the MoE's expert GEMMs, the bulk of the skippable work,
          are saved).
`auto` = static on CUDA, gather elsewhere.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from nagmoe.ops.position_attention import POSITION_CHUNK
from nagmoe.config.schema import ELIGIBLE_MODES, eligible_sublayers  # noqa: F401  (the MoD eligibility rule)



MOD_IMPLS = ("auto", "gather", "static")


def resolve_mod_impl(setting: str, device_type: str) -> str:
    """`model.mod.impl` for a device type: auto = static on CUDA, gather elsewhere (module docstring)."""
    if setting not in MOD_IMPLS:
        raise ValueError(f"model.mod.impl: {setting!r} is not one of {', '.join(MOD_IMPLS)}")
    if setting == "auto":
        return "static" if device_type == "cuda" else "gather"
    return setting


class Selection(NamedTuple):
    """model.mod.impl=static: the tokens of a (B, T) batch that execute a sublayer, as a device mask only. A
    sublayer called with `select=Selection` computes every token (fixed shapes) and its output rows of skipped
    tokens are discarded by the stream; a MoE gives them no expert slot and no statistic."""
    mask_BT: torch.Tensor


def _true_rows(mask_N: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the `n` True entries of a flat mask, ascending, without a host sync (`nonzero` must read its
    output size; here the caller knows it)."""
    if hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask_N, size=n).squeeze(1)
        except (NotImplementedError, RuntimeError):  # a device without the kernel: the sort below
            pass
    t_N = torch.arange(mask_N.numel(), device=mask_N.device)
    return torch.where(mask_N, t_N, t_N + mask_N.numel()).argsort()[:n]


# ----------------------------------------------------------------------------------------------------------
# Executed tokens: gather / scatter, flat and padded layouts
# ----------------------------------------------------------------------------------------------------------
class ExecutedTokens:
    """The tokens of a (B, T) batch that execute a sublayer, from a boolean mask.

    Flat layout: `gather(x_BT...) -> x_N...` (row-major order) and `scatter(y_N...) -> y_BT...` (zeros
    elsewhere). Padded layout (attention queries): `positions_BM` holds each sequence's executed positions in
    order (T-relative), `valid_BM` marks the real ones among the M = max count slots; `to_padded(x_N...)` /
    `from_padded(x_BM...)` move between the two (padding rows are zeros). All moves are index_select /
    index_copy on precomputed row indices (their backwards are index_add / index_select: no boolean-mask
    index_put, which is serial on CPU)."""

    def __init__(self, mask_BT: torch.Tensor, flags: Optional[torch.Tensor] = None, queries: bool = True,
                 chunk: int = POSITION_CHUNK):
        """One device->host read (issue 26's budget: one per MoD sublayer) brings `flags` (the caller's own
        small integer tensor, e.g. the calibrator's "does this sublayer skip"; `self.flags` as a list), `n`
        (executed tokens), `M` (the most in one sequence) and, for attention (`queries`), `key_ends`: per
        padded query slot m, the keys any sequence's m-th executed query may see (running max of position + 1;
        attention_at_positions cuts its key blocks there), and `chunk_rows`: per chunk of `chunk` positions,
        the most executed tokens of one sequence in it (the CPU chunked kernel's layout,
        nagmoe/ops/position_attention.py). Nothing else syncs: the flat rows come from `nonzero_static` (or a
        sort) of the known size."""
        self.mask_BT = mask_BT
        self.B, self.T = mask_BT.shape
        self.counts_B = mask_BT.sum(1)
        self.chunk = chunk
        device = mask_BT.device
        flags_F = (flags if flags is not None else torch.zeros(0, device=device)).long().view(-1)
        self._positions_BT = None
        parts = [flags_F]
        if self.B:
            parts += [self.counts_B.sum().view(1), self.counts_B.max().view(1)]
            if queries:  # executed positions first, ascending (keys are unique: no ties); padding at 0
                t_T = torch.arange(self.T, device=device)
                order_BT = torch.where(mask_BT, t_T, t_T + self.T).argsort(dim=1)
                self._positions_BT = order_BT.where(t_T < self.counts_B.unsqueeze(1), 0)
                parts.append(self._positions_BT.amax(0).cummax(0).values + 1)
                chunks = -(-self.T // chunk)
                padded_BT = torch.nn.functional.pad(mask_BT, (0, chunks * chunk - self.T))
                parts.append(padded_BT.view(self.B, chunks, chunk).sum(-1).amax(0))
        values = torch.cat(parts).tolist()  # the one read
        f = flags_F.numel()
        self.flags = values[:f]
        self.n, self.M = (values[f], values[f + 1]) if self.B else (0, 0)
        self.key_ends = values[f + 2:f + 2 + self.M] if self._positions_BT is not None else None
        self.chunk_rows = values[f + 2 + self.T:] if self._positions_BT is not None else None  # after T key ends
        self.index_N = _true_rows(mask_BT.reshape(-1), self.n)  # flat rows of (B·T), ascending
        self._padded = None

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_.reshape(self.B * self.T, *x_BT_.shape[2:]).index_select(0, self.index_N)

    def scatter(self, y_N_: torch.Tensor) -> torch.Tensor:
        out = y_N_.new_zeros(self.B * self.T, *y_N_.shape[1:]).index_copy(0, self.index_N, y_N_)
        return out.view(self.B, self.T, *y_N_.shape[1:])

    def scatter_onto(self, base: torch.Tensor, y_N_: torch.Tensor) -> torch.Tensor:
        """`base` (broadcast to every token's row) plus `y` on the executed rows: MoD's f̂ = X_l + F(R̄) for
        executed tokens and f̂ = X_l for skipped ones, as one write of the (B, T, ...) output and an add on the N
        executed rows (not zeros, a copy and a full-size add). Equal to `base + scatter(y)` bit for bit."""
        rows = (self.B * self.T, *y_N_.shape[1:])
        out = torch.index_add(base.to(y_N_.dtype).expand(rows), 0, self.index_N, y_N_)
        return out.view(self.B, self.T, *y_N_.shape[1:])

    def gather_padded(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """The executed tokens of a (B, T, ...) tensor straight into the padded (B, M, ...) layout (one copy:
        `to_padded(gather(x))` makes two). Padding slots hold each sequence's token 0 instead of zeros; callers
        drop them with `from_padded`, so they get no gradient."""
        positions_BM, _ = self.padded()
        rows_BM = positions_BM + self.T * torch.arange(self.B, device=positions_BM.device).unsqueeze(1)
        flat = x_BT_.reshape(self.B * self.T, *x_BT_.shape[2:]).index_select(0, rows_BM.reshape(-1))
        return flat.view(self.B, self.M, *x_BT_.shape[2:])

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions_BM, valid_BM); executed positions first, ascending; padding slots at position 0."""
        if self._padded is None:
            M, t_T = self.M, torch.arange(self.T, device=self.mask_BT.device)
            if self._positions_BT is None:
                order_BT = torch.where(self.mask_BT, t_T, t_T + self.T).argsort(dim=1)
                self._positions_BT = order_BT.where(t_T < self.counts_B.unsqueeze(1), 0)
            valid_BM = t_T[:M] < self.counts_B.unsqueeze(1)
            positions_BM = self._positions_BT[:, :M]
            # padded slot of each executed token: b·M + its rank within its sequence
            rank_N = (self.mask_BT.cumsum(1) - 1).reshape(-1).index_select(0, self.index_N)
            self.slot_N = torch.div(self.index_N, self.T, rounding_mode="floor") * M + rank_N
            self._padded = (positions_BM, valid_BM)
        return self._padded

    def key_ends_at(self, offset: int) -> Optional[list]:
        """`key_ends` for keys that start `offset` positions earlier (an inference cache)."""
        return None if self.key_ends is None else [e + offset for e in self.key_ends]

    def position_chunks(self, offset: int) -> Optional[tuple]:
        """(valid_BM, chunk_rows, chunk) for attention_at_positions' chunked CPU kernel; None after a cached
        prefix (`offset` > 0: the chunks are counted on this call's own positions) or without query data."""
        if offset or self.chunk_rows is None:
            return None
        return self.padded()[1], self.chunk_rows, self.chunk

    def to_padded(self, x_N_: torch.Tensor) -> torch.Tensor:
        self.padded()
        out = x_N_.new_zeros(self.B * self.M, *x_N_.shape[1:]).index_copy(0, self.slot_N, x_N_)
        return out.view(self.B, self.M, *x_N_.shape[1:])

    def from_padded(self, x_BM_: torch.Tensor) -> torch.Tensor:
        self.padded()
        return x_BM_.reshape(self.B * self.M, *x_BM_.shape[2:]).index_select(0, self.slot_N)


def run_on_executed(sublayer: Callable, x_BTD: torch.Tensor, select: Optional[ExecutedTokens] = None):
    """A per-token sublayer (dense FFN, MoE) on the executed tokens only: `(y_ND, aux[, gate_scale_N])` for
    the N gathered tokens, or the sublayer's own output when `select` is None or a `Selection` (static: a MoE
    takes it and routes only the executed tokens; a dense FFN computes every token). The MoE routes only these
    tokens (its aux losses are statistics of the executed tokens)."""
    if select is None:
        return sublayer(x_BTD)
    if isinstance(select, Selection):  # static: every token, full shapes; the stream keeps the executed rows
        return sublayer(x_BTD, select=select) if hasattr(sublayer, "lb_granularity") else sublayer(x_BTD)
    # a MoE balancing per sequence needs each gathered token's row (model.moe.lb_granularity=sequence)
    rows = ({"rows": (torch.div(select.index_N, select.T, rounding_mode="floor"), select.B)}
            if getattr(sublayer, "lb_granularity", None) == "sequence" else {})
    out = sublayer(select.gather(x_BTD).unsqueeze(0), **rows)
    return (out[0].squeeze(0), out[1], *(t.squeeze(0) for t in out[2:]))


