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
          are saved). The decision itself (`static_decision`: the mask, the counts, the score histogram) is
          made inside the sublayer's compiled unit, not between units (issue 69, item 3).
`auto` = static on CUDA, gather elsewhere.
"""
from __future__ import annotations

from typing import Callable, Optional

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


class Selection:
    """model.mod.impl=static: the tokens of a (B, T) batch that execute a sublayer, as a device mask only. A
    sublayer called with `select=Selection` computes every token (fixed shapes) and its output rows of skipped
    tokens are discarded by the stream; a MoE gives them no expert slot and no statistic.

    Made from a mask (`Selection(mask_BT)`) or, as the calibrator hands it out, undecided: `decision` holds the
    inputs of `static_decision` and `resolve()` computes the mask and the call's counts from them. Every
    sublayer's forward resolves it first thing (`decide`), so a compiled sublayer makes the decision inside its
    MoD unit's graph (issue 69, item 3); one that never ran it (a spy, a test) resolves at the first read of
    `mask_BT` or `counts_1P`."""

    def __init__(self, mask_BT: Optional[torch.Tensor] = None, decision: Optional[tuple] = None):
        self.decision = decision
        self.decided_mask_BT, self.decided_counts_1P = mask_BT, None

    def resolve(self) -> "Selection":
        """Make the decision (again, if made: a checkpoint's recompute makes the same one from the same inputs).
        Always recomputed, never tested for: a compiled unit then guards on nothing but the inputs."""
        if self.decision is not None:
            self.decided_mask_BT, self.decided_counts_1P = static_decision(*self.decision)
        return self

    @property
    def mask_BT(self) -> torch.Tensor:
        if self.decided_mask_BT is None:
            self.resolve()
        return self.decided_mask_BT

    @property
    def counts_1P(self) -> Optional[torch.Tensor]:
        """The call's counts (`static_decision`), None for a Selection made from a mask."""
        if self.decided_counts_1P is None and self.decision is not None:
            self.resolve()
        return self.decided_counts_1P


def decide(select):
    """`select` with static MoD's decision made (`Selection.resolve`), anything else as given. A sublayer's forward
    calls it first: compiled, the decision is traced in the forward's own frame, so a graph break later in it
    (the MoE's expert call) splits nothing more."""
    return select.resolve() if isinstance(select, Selection) else select


COUNTS = ("executed", "tokens", "padded")  # the first columns of static_decision's counts; then the histogram


def score_bins(score_BT: torch.Tensor, bins: int) -> torch.Tensor:
    """The histogram bin of each score, flattened: k = clamp(floor(r·K), 0, K-1), K = `bins` (gather's counts and
    static's decision bin alike, so both calibrate from the same histogram)."""
    return (score_BT.reshape(-1).float() * bins).long().clamp(0, bins - 1)


def static_decision(score_BT: torch.Tensor, threshold_n: torch.Tensor, skipping_n: torch.Tensor,
                    index_1: torch.Tensor, bins: int, histogram: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Static MoD's decision for one call of sublayer l = `index_1` (a (1,) device index into the calibrator's
    (n,) thresholds and skip flags: no per-sublayer python int reaches a compiled unit's guards), with fixed shapes
    and no host read:
        mask_BT = (r > p_l) | ¬skipping_l            (before the start every token executes: the same graph)
    and its counts as one (1, P) float64 row, P = 3 (+ K with `histogram`, a training forward):
        [executed Σ mask, tokens B·T, padded B·max_b Σ_t mask_bt (attention's padded query rows under gather),
         score histogram h_k = #{t : clamp(floor(r_t·K), 0, K-1) = k}, K = `bins`].
    Integer-valued, so the calibrator's sums are exact whatever their order (gather's counts, bit for bit)."""
    B, score_BT = score_BT.shape[0], score_BT.detach()  # a decision: no gradient
    threshold_1, skipping_1 = threshold_n.index_select(0, index_1), skipping_n.index_select(0, index_1)
    mask_BT = (score_BT > threshold_1) | ~skipping_1
    counts_B = mask_BT.sum(1)
    executed = counts_B.sum()
    padded = counts_B.amax() * B if B else executed
    parts = [torch.stack([executed, torch.full_like(executed, score_BT.numel()), padded]).to(torch.float64)]
    if histogram:
        bin_N = score_bins(score_BT, bins)
        ones_N = torch.ones(bin_N.shape, dtype=torch.float64, device=bin_N.device)
        parts.append(torch.zeros(bins, dtype=torch.float64, device=bin_N.device).index_add(0, bin_N, ones_N))
    return mask_BT, torch.cat(parts).unsqueeze(0)


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
    the N gathered tokens, or the sublayer's own output when `select` is None or a `Selection` (static: the
    sublayer makes the decision; a MoE routes only the executed tokens, a dense FFN computes every token). The
    MoE routes only these tokens (its aux losses are statistics of the executed tokens)."""
    if select is None:
        return sublayer(x_BTD)
    if isinstance(select, Selection):  # static: every token, full shapes; the stream keeps the executed rows
        return sublayer(x_BTD, select=select)
    # a MoE balancing per sequence needs each gathered token's row (model.moe.lb_granularity=sequence)
    rows = ({"rows": (torch.div(select.index_N, select.T, rounding_mode="floor"), select.B)}
            if getattr(sublayer, "lb_granularity", None) == "sequence" else {})
    out = sublayer(select.gather(x_BTD).unsqueeze(0), **rows)
    return (out[0].squeeze(0), out[1], *(t.squeeze(0) for t in out[2:]))


