"""Mixture-of-Depths from the NAG geometry (reference/nag.md, "Mixture-of-Depths from the geometry").

Legend: B batch, T sequence (the new tokens when decoding), D model width, N executed tokens of the batch
(flat, row-major over (B, T)), M = the most executed tokens of one sequence (padded layout), n sublayers,
K histogram bins.

Per NAG sublayer l, before it runs, every token has a rotation score r = arctan(α·m) / arctan(α) ∈ [0, 1]
(nag.rotation_score): the rotation the sublayer would apply as a fraction of its ceiling. Tokens with
r > p_l (the sublayer's threshold) execute F; the others do not. A learned base vector X_l is added for
every token (f̂ = F(R̄) + X_l executed, f̂ = X_l skipped), then the NAG update with scale α·m·warmup.

Thresholds (`MoDCalibrator`, ours; docs/decisions.md): a per-sublayer histogram of scores over K uniform bins
of [0, 1], decayed per optimizer step (H <- decay·H + this step's counts). After each step
`update(reduce_fn)` sums the step's counts over data-parallel ranks (`reduce_fn`, an all-reduce SUM passed in
by the trainer: model code stays single-device), folds them in and sets p_l to a quantile of H_l (linear
inside a bin) at the level skip_rate + c_l, where c_l integrates the gap between target and realised skip
rate (the scores drift during training; a quantile of past scores alone lags). The threshold used at step t
therefore comes only from scores of steps < t: a token's decision depends on nothing but its own score
(causal), and every rank uses the same thresholds.
Histograms and thresholds are buffers, saved in the checkpoint and used unchanged at generation;
`set_skip_rate(rate)` re-reads the histograms for another rate (the post-training compute dial).
Skipping starts once `max(model.mod.start_tokens, model.nag.warmup_tokens)` tokens have been seen; before
that every token executes but the histograms calibrate.

Batching (`ExecutedTokens`): FFN/MoE run on a flat `(N, D)` gather of the executed tokens; attention keeps
K and V for every token and runs its executed queries in a padded per-sequence layout `(B, M)` with their
original positions (mask `key <= position`), so the score work is B·M·L instead of B·T·L.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from nagmoe.errors import UserError

ELIGIBLE_MODES = ("all", "attention", "ffn", "every_other")
EXECUTE_ALL = -1.0  # a threshold below every score (r >= 0)


def eligible_sublayers(n_layers: int, mode: str) -> list[bool]:
    """Which of the 2·n_layers sublayers (attention of block i at 2i, its FFN at 2i+1) may skip tokens.
    `every_other`: both sublayers of the odd blocks (1, 3, ...), so block 0 always runs at full depth."""
    if mode not in ELIGIBLE_MODES:
        raise UserError(f"model.mod.sublayers: {mode!r} is not one of {', '.join(ELIGIBLE_MODES)}")
    out = []
    for index in range(2 * n_layers):
        block, is_attention = index // 2, index % 2 == 0
        out.append({"all": True, "attention": is_attention, "ffn": not is_attention,
                    "every_other": block % 2 == 1}[mode])
    if not any(out):
        raise UserError(f"model.mod.sublayers: {mode!r} with model.n_layers={n_layers} leaves no sublayer to skip")
    return out


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

    def __init__(self, mask_BT: torch.Tensor):
        self.mask_BT = mask_BT
        self.B, self.T = mask_BT.shape
        self.counts_B = mask_BT.sum(1)
        self.index_N = mask_BT.reshape(-1).nonzero().squeeze(1)  # flat rows of (B·T), ascending
        self.n = int(self.index_N.numel())
        self._padded = None

    def gather(self, x_BT_: torch.Tensor) -> torch.Tensor:
        return x_BT_.reshape(self.B * self.T, *x_BT_.shape[2:]).index_select(0, self.index_N)

    def scatter(self, y_N_: torch.Tensor) -> torch.Tensor:
        out = y_N_.new_zeros(self.B * self.T, *y_N_.shape[1:]).index_copy(0, self.index_N, y_N_)
        return out.view(self.B, self.T, *y_N_.shape[1:])

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions_BM, valid_BM); executed positions first, ascending (keys are unique: no ties)."""
        if self._padded is None:
            M = int(self.counts_B.max()) if self.B else 0
            t_T = torch.arange(self.T, device=self.mask_BT.device)
            key_BT = torch.where(self.mask_BT, t_T, t_T + self.T)
            valid_BM = torch.arange(M, device=t_T.device) < self.counts_B.unsqueeze(1)
            positions_BM = key_BT.argsort(dim=1)[:, :M].where(valid_BM, 0)  # padding slots at position 0
            # padded slot of each executed token: b·M + its rank within its sequence
            rank_N = (self.mask_BT.cumsum(1) - 1).reshape(-1).index_select(0, self.index_N)
            self.slot_N = torch.div(self.index_N, self.T, rounding_mode="floor") * M + rank_N
            self.M = M
            self._padded = (positions_BM, valid_BM)
        return self._padded

    def to_padded(self, x_N_: torch.Tensor) -> torch.Tensor:
        self.padded()
        out = x_N_.new_zeros(self.B * self.M, *x_N_.shape[1:]).index_copy(0, self.slot_N, x_N_)
        return out.view(self.B, self.M, *x_N_.shape[1:])

    def from_padded(self, x_BM_: torch.Tensor) -> torch.Tensor:
        self.padded()
        return x_BM_.reshape(self.B * self.M, *x_BM_.shape[2:]).index_select(0, self.slot_N)


def run_on_executed(sublayer: Callable, x_BTD: torch.Tensor, select: Optional[ExecutedTokens] = None):
    """A per-token sublayer (dense FFN, MoE) on the executed tokens only: `(y_ND, aux[, gate_scale_N])` for
    the N gathered tokens, or the sublayer's own output when `select` is None. The MoE routes only these
    tokens (its aux losses are statistics of the executed tokens)."""
    if select is None:
        return sublayer(x_BTD)
    out = sublayer(select.gather(x_BTD).unsqueeze(0))
    return (out[0].squeeze(0), out[1], *(t.squeeze(0) for t in out[2:]))


# ----------------------------------------------------------------------------------------------------------
# Thresholds: causal streaming histograms
# ----------------------------------------------------------------------------------------------------------
def histogram_quantile(hist_nK: torch.Tensor, rate) -> torch.Tensor:
    """Per row, the value q in [0, 1] with a fraction `rate` (a float, or one per row) of the histogram's mass
    at or below it, linear inside a bin (bins uniform on [0, 1]); EXECUTE_ALL where rate <= 0 or the row is
    empty."""
    n, K = hist_nK.shape
    total_n = hist_nK.sum(1)
    rate_n = torch.as_tensor(rate, dtype=torch.float64, device=hist_nK.device).expand(n)
    cdf_nK = hist_nK.cumsum(1) / total_n.clamp_min(1e-300).unsqueeze(1)
    bin_n = torch.searchsorted(cdf_nK, rate_n.unsqueeze(1).contiguous()).squeeze(1).clamp(max=K - 1)  # cdf >= rate
    below_n = torch.where(bin_n > 0, cdf_nK.gather(1, (bin_n - 1).clamp_min(0).unsqueeze(1)).squeeze(1),
                          torch.zeros_like(total_n))
    at_n = cdf_nK.gather(1, bin_n.unsqueeze(1)).squeeze(1)
    inside_n = ((rate_n - below_n) / (at_n - below_n).clamp_min(1e-300)).clamp(0, 1)
    q_n = (bin_n.to(torch.float64) + inside_n) / K
    return torch.where((total_n > 0) & (rate_n > 0), q_n, torch.full_like(q_n, EXECUTE_ALL))


class MoDCalibrator(nn.Module):
    """Per-sublayer skip thresholds from causal score histograms (module docstring).

    Threshold of sublayer l for the next step: the quantile at level `skip_rate + correction_l` of the
    decayed histogram H_l. The correction is an integral controller on the realised skip rate,
    correction_l += gain · (skip_rate - realised_l) after every skipping step: the scores drift while the
    model trains, so a quantile of past scores alone lags (measured on the micro config: 10-15% skipped for
    a 20% target); the controller removes that bias and, like everything here, uses earlier steps only.

    Buffers saved in the checkpoint: `threshold (n,)` (used by the next forward), `histogram (n, K)`,
    `correction (n,)`, `skipping (n,)` (bool: the sublayer skips; off before the start and for ineligible
    sublayers), `tokens_seen ()`, and the run totals `executed_total (n,)`, `tokens_total ()` (the run's
    realised executed fractions). Not saved: this step's pending counts (empty at every step boundary,
    where checkpoints are taken) and the decision counters of forwards outside training (generation)."""

    def __init__(self, n_sublayers: int, skip_rate: float, eligible: Sequence[bool], start_tokens: int = 0,
                 bins: int = 2048, decay: float = 0.5, correction_gain: float = 0.5):
        super().__init__()
        if not 0.0 <= skip_rate < 1.0:
            raise UserError(f"model.mod.skip_rate: {skip_rate} must be in [0, 1)")
        if len(eligible) != n_sublayers:
            raise ValueError(f"MoDCalibrator: {len(eligible)} eligibility flags for {n_sublayers} sublayers")
        self.n_sublayers, self.skip_rate, self.start_tokens = n_sublayers, float(skip_rate), int(start_tokens)
        self.bins, self.decay, self.correction_gain = int(bins), float(decay), float(correction_gain)
        self.eligible_list = [bool(e) for e in eligible]  # python copy: no device sync per forward
        n, f64 = n_sublayers, torch.float64
        self.register_buffer("eligible", torch.tensor(self.eligible_list, dtype=torch.bool), persistent=False)
        self.register_buffer("threshold", torch.full((n,), EXECUTE_ALL, dtype=torch.float32))
        self.register_buffer("histogram", torch.zeros(n, self.bins, dtype=f64))
        self.register_buffer("correction", torch.zeros(n, dtype=f64))
        self.register_buffer("skipping", torch.zeros(n, dtype=torch.bool))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=f64))
        self.register_buffer("executed_total", torch.zeros(n, dtype=f64))
        self.register_buffer("tokens_total", torch.zeros((), dtype=f64))
        # this step's counts (training forwards), folded in by update()
        self.register_buffer("pending_hist", torch.zeros(n, self.bins, dtype=f64), persistent=False)
        self.register_buffer("pending_executed", torch.zeros(n, dtype=f64), persistent=False)
        self.register_buffer("pending_tokens", torch.zeros(n, dtype=f64), persistent=False)
        # decisions of forwards outside training (generation, evaluation), for reporting only
        self.register_buffer("inference_executed", torch.zeros(n, dtype=f64), persistent=False)
        self.register_buffer("inference_tokens", torch.zeros(n, dtype=f64), persistent=False)

    def extra_repr(self) -> str:
        return (f"skip_rate={self.skip_rate}, eligible={sum(self.eligible_list)}/{self.n_sublayers}, "
                f"start_tokens={self.start_tokens}, bins={self.bins}, decay={self.decay}, "
                f"correction_gain={self.correction_gain}")

    # ------------------------------------------------------------------------------------------------------
    def select(self, index: int, score_BT: torch.Tensor) -> Optional[ExecutedTokens]:
        """The executed tokens of sublayer `index` (score > threshold), or None when it runs every token
        (ineligible, or not skipping yet). Training forwards add the scores to this step's histogram."""
        if not self.eligible_list[index]:
            return None
        score_BT = score_BT.detach()
        skipping = bool(self.skipping[index])
        mask_BT = score_BT > self.threshold[index] if skipping else None
        executed = mask_BT.sum() if skipping else score_BT.numel()
        if self.training:
            bin_N = (score_BT.reshape(-1).float() * self.bins).long().clamp_(0, self.bins - 1)
            self.pending_hist[index] += torch.bincount(bin_N, minlength=self.bins).to(self.pending_hist.dtype)
            self.pending_tokens[index] += score_BT.numel()
            self.pending_executed[index] += executed
        else:
            self.inference_tokens[index] += score_BT.numel()
            self.inference_executed[index] += executed
        return ExecutedTokens(mask_BT) if skipping else None

    @torch.no_grad()
    def update(self, reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list[float]:
        """After an optimizer step: sum this step's counts over ranks (`reduce_fn`: all-reduce SUM, or None
        for one process), fold them into the histograms and the correction, set the thresholds of the next
        step and return the realised executed fraction of each sublayer in the step just taken (1.0 where
        nothing skipped)."""
        n, K = self.n_sublayers, self.bins
        packed = torch.cat([self.pending_hist.reshape(-1), self.pending_executed, self.pending_tokens])
        if reduce_fn is not None:  # an all-reduce SUM, in place or returning the sum
            reduced = reduce_fn(packed)
            packed = packed if reduced is None else reduced
        hist_nK = packed[: n * K].view(n, K)
        executed_n, tokens_n = packed[n * K: n * K + n], packed[n * K + n:]
        step_tokens = tokens_n.max()  # every eligible sublayer sees every token; others record nothing
        fractions_n = torch.where(self.eligible & (tokens_n > 0), executed_n / tokens_n.clamp_min(1),
                                  torch.ones_like(executed_n))
        self.executed_total += fractions_n * step_tokens
        self.tokens_total += step_tokens
        self.tokens_seen += step_tokens
        self.histogram.mul_(self.decay).add_(hist_nK)
        # integral control of the realised skip rate, on the sublayers that skipped in this step
        error_n = self.skip_rate - (1.0 - fractions_n)
        active_n = self.skipping & (tokens_n > 0)
        self.correction.add_(torch.where(active_n, self.correction_gain * error_n, torch.zeros_like(error_n)))
        self.correction.clamp_(-self.skip_rate, 0.99 - self.skip_rate)
        self._set_thresholds(self.skip_rate + self.correction)
        started = bool(self.tokens_seen >= self.start_tokens)
        self.skipping.copy_(self.eligible & (self.histogram.sum(1) > 0) & started & (self.skip_rate > 0))
        for buf in (self.pending_hist, self.pending_executed, self.pending_tokens):
            buf.zero_()
        return fractions_n.tolist()

    def _set_thresholds(self, level) -> None:
        q_n = histogram_quantile(self.histogram, level).to(self.threshold.dtype)
        self.threshold.copy_(torch.where(self.eligible, q_n, torch.full_like(q_n, EXECUTE_ALL)))

    @torch.no_grad()
    def set_skip_rate(self, rate: float) -> None:
        """The compute dial after training: thresholds at the `rate` quantile of the saved histograms (no
        correction: the scores no longer drift); 0 runs every token. Skipping starts at once (the start
        only applies to training)."""
        if not 0.0 <= rate < 1.0:
            raise UserError(f"--skip-rate: {rate} must be in [0, 1)")
        calibrated = self.histogram.sum(1) > 0
        if rate > 0 and not bool(calibrated[self.eligible].all()):
            raise UserError("--skip-rate: this model has no score histograms yet (it was never trained with MoD)")
        self.skip_rate = float(rate)
        self.correction.zero_()
        self._set_thresholds(rate)
        self.skipping.copy_(self.eligible & calibrated & (rate > 0))

    # ------------------------------------------------------------------------------------------------------
    def run_executed_fractions(self) -> list[float]:
        """Token-weighted executed fraction per sublayer over every step so far (1.0 before any step)."""
        if float(self.tokens_total) == 0:
            return [1.0] * self.n_sublayers
        return (self.executed_total / self.tokens_total).tolist()

    def skip_rate_of(self, fractions: Sequence[float]) -> float:
        """Realised skip rate: 1 - mean executed fraction over the eligible sublayers (the quantity
        model.mod.skip_rate targets)."""
        chosen = [f for f, e in zip(fractions, self.eligible.tolist()) if e]
        return 1.0 - sum(chosen) / len(chosen)

    def inference_skip_rate(self) -> Optional[float]:
        """Realised skip rate of the forwards outside training so far (None before any)."""
        tokens = self.inference_tokens
        if float(tokens.max()) == 0:
            return None
        return self.skip_rate_of((self.inference_executed / tokens.clamp_min(1)).where(
            tokens > 0, torch.ones_like(tokens)).tolist())
