"""MoD skip thresholds from causal streaming histograms of the rotation score, in three modes (ours: the
paper's calibration is not public; docs/decisions.md, "one threshold on the rotation score").

Legend: n sublayers, K histogram bins (uniform on [0, 1]). A token skips sublayer l when its rotation score
r ≤ p_l (it executes when r > p_l). F_l(p) = the share of sublayer l's (decayed) score histogram at or below p,
linear inside a bin; Q_l(q) its inverse (the quantile). w_l = sublayer l's skippable work per token (the FLOP
accounting's, `nagmoe.config.flops.skippable_flops_per_sublayer`), c_l = the ceiling `model.mod.max_sublayer_skip`.

- `global` (default for new runs): ONE threshold p for every eligible sublayer, the seed's rule ("when does a
  rotation become worth paying for with compute?"), with p solving the work-weighted target
      Σ_l w_l · min(F_l(p), c_l) / Σ_l w_l = level,     level = skip_rate + correction,
  a monotone mixture of the per-sublayer distributions (bisection). Sublayer thresholds p_l = min(p, Q_l(c_l)):
  a sublayer whose rotations are small skips more, one whose rotations are large skips less, none above its
  ceiling. The correction integrates (target − realised work-weighted skip) after every skipping step (the
  scores drift while the model trains; a quantile of past scores alone lags).
- `per_sublayer` (legacy): p_l = Q_l(min(skip_rate + correction_l, c_l)) with one integral controller per
  sublayer: every sublayer skips ~skip_rate of its tokens.
- `fixed`: p_l = min(p_thres, Q_l(c_l)), the seed's literal rule (`model.mod.p_thres`), no controller.

Histograms fold in each optimizer step's counts (H <- decay·H + counts, summed over data-parallel ranks by the
trainer's `reduce_fn`) after the step: the thresholds used at step t come from scores of steps < t only, so a
token's decision depends on its own score alone (causal) and every rank uses the same thresholds. Histograms,
thresholds and corrections are buffers saved in the checkpoint and used unchanged at generation;
`set_skip_rate(rate, level)` is the compute dial (`calibrate_skip_rate` below calibrates `level` so that the
realised rate is the requested one; eval, analysis and export use it).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from nagmoe.base.errors import UserError
from nagmoe.model.mod import COUNTS, ExecutedTokens, Selection, resolve_mod_impl, score_bins

EXECUTE_ALL = -1.0  # a threshold below every score (r >= 0)
THRESHOLD_MODES = ("global", "per_sublayer", "fixed")
_BISECTIONS = 40  # p in [0, 1] to 1e-12


def realised_skip_rate(executed: Sequence[float], eligible: Optional[Sequence[bool]] = None,
                       weights: Optional[Sequence[float]] = None) -> float:
    """The skipped share of the eligible sublayers' work, Σ w_l (1 − f_l) / Σ w_l (all eligible when `eligible`
    is None; w_l = 1 when `weights` is None: the mean executed fraction)."""
    n = len(executed)
    pairs = [(w, f) for f, ok, w in zip(executed, eligible or [True] * n, weights or [1.0] * n) if ok]
    return sum(w * (1.0 - f) for w, f in pairs) / sum(w for w, _ in pairs)


def histogram_cdf(hist_nK: torch.Tensor, p) -> torch.Tensor:
    """F_n(p): per row, the share of the histogram's mass at or below p (a float or one per row), linear inside
    a bin; 0 for an empty row."""
    n, K = hist_nK.shape
    total_n = hist_nK.sum(1)
    p_n = torch.as_tensor(p, dtype=torch.float64, device=hist_nK.device).expand(n).clamp(0.0, 1.0)
    pos_n = p_n * K
    bin_n = pos_n.floor().long().clamp(max=K - 1)
    cum_nK = hist_nK.cumsum(1)
    below_n = torch.where(bin_n > 0, cum_nK.gather(1, (bin_n - 1).clamp_min(0).unsqueeze(1)).squeeze(1),
                          torch.zeros_like(total_n))
    inside_n = hist_nK.gather(1, bin_n.unsqueeze(1)).squeeze(1) * (pos_n - bin_n)
    return ((below_n + inside_n) / total_n.clamp_min(1e-300)).where(total_n > 0, torch.zeros_like(total_n))


def histogram_quantile(hist_nK: torch.Tensor, rate) -> torch.Tensor:
    """Q_n(rate): per row, the value q in [0, 1] with a share `rate` (a float, or one per row) of the
    histogram's mass at or below it, linear inside a bin; EXECUTE_ALL where rate <= 0 or the row is empty."""
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


def work_skip(hist_nK: torch.Tensor, weight_n: torch.Tensor, cap_n: torch.Tensor, p) -> torch.Tensor:
    """Σ_n w_n · min(F_n(p), c_n) / Σ_n w_n: the skipped share of the work at one threshold p (weights 0 for
    the sublayers that do not take part)."""
    return (weight_n * torch.minimum(histogram_cdf(hist_nK, p), cap_n)).sum() / weight_n.sum().clamp_min(1e-300)


def global_threshold(hist_nK: torch.Tensor, weight_n: torch.Tensor, cap_n: torch.Tensor, level) -> torch.Tensor:
    """The smallest p in [0, 1] whose work-weighted skip reaches `level` (a float or 0-dim tensor), as a 0-dim
    float64 tensor: bisection on the device (the skip is monotone in p), no host read; 1.0 where the ceilings
    make the level unreachable, EXECUTE_ALL for level <= 0."""
    level = torch.as_tensor(level, dtype=torch.float64, device=hist_nK.device)
    lo, hi = torch.zeros_like(level), torch.ones_like(level)
    reachable = work_skip(hist_nK, weight_n, cap_n, hi) >= level
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        ok = work_skip(hist_nK, weight_n, cap_n, mid) >= level
        hi, lo = torch.where(ok, mid, hi), torch.where(ok, lo, mid)
    return torch.where(level <= 0, torch.full_like(level, EXECUTE_ALL), torch.where(reachable, hi, 1.0))


class SkipRateUnavailable(ValueError):
    """The compute dial cannot set this skip rate on this model. The model knows no command line: the commands
    that take --skip-rate (generate, export-hf) turn it into their one-line UserError."""


class MoDCalibrator(nn.Module):
    """Skip thresholds per sublayer from causal score histograms (module docstring).

    Buffers saved in the checkpoint: `threshold (n,)` (used by the next forward), `histogram (n, K)`,
    `correction (n,)` (global mode: the one correction, in every eligible entry), `skipping (n,)` (bool: the
    sublayer skips; off before the start and for ineligible sublayers), `tokens_seen ()`, and the run totals
    `executed_total (n,)`, `tokens_total ()`. Not saved: the work weights (from the config), this step's
    pending counts (empty at every step boundary, where checkpoints are taken) and the counters of forwards
    outside training (generation, evaluation, the dial's calibration). The counts are packed one row per
    sublayer, `pending (n, 3 + K)` and `inference (n, 3)`, in static_decision's column order (executed, tokens,
    padded, histogram), so a static call adds its row in one op; `pending_executed`, `pending_tokens`,
    `pending_padded`, `pending_hist`, `inference_executed` and `inference_tokens` are views of them."""

    def __init__(self, n_sublayers: int, skip_rate: float, eligible: Sequence[bool], start_tokens: int = 0,
                 bins: int = 2048, decay: float = 0.5, correction_gain: float = 0.5, mode: str = "per_sublayer",
                 work_weights: Optional[Sequence[float]] = None, max_sublayer_skip: Optional[float] = None,
                 p_thres: Optional[float] = None, impl: str = "auto"):
        super().__init__()
        resolve_mod_impl(impl, "cpu")  # a known setting (the config check names it for users)
        self.impl = impl  # model.mod.impl: gather | static | auto (per device: resolved_impl)
        if not 0.0 <= skip_rate < 1.0:
            raise UserError(f"model.mod.skip_rate: {skip_rate} must be in [0, 1)")
        if len(eligible) != n_sublayers:
            raise ValueError(f"MoDCalibrator: {len(eligible)} eligibility flags for {n_sublayers} sublayers")
        if mode not in THRESHOLD_MODES:
            raise UserError(f"model.mod.threshold: {mode!r} is not one of {', '.join(THRESHOLD_MODES)}")
        if mode == "fixed" and p_thres is None:
            raise UserError("model.mod.p_thres: required by model.mod.threshold=fixed")
        self.n_sublayers, self.skip_rate, self.start_tokens = n_sublayers, float(skip_rate), int(start_tokens)
        self.bins, self.decay, self.correction_gain = int(bins), float(decay), float(correction_gain)
        self.mode, self.p_thres = mode, p_thres
        self.max_sublayer_skip = max_sublayer_skip
        self.eligible_list = [bool(e) for e in eligible]  # python copy: no device sync per forward
        self.work_weight_list: list[float] = []  # python copy of the work weights (set_work_weights)
        n, f64 = n_sublayers, torch.float64
        self.register_buffer("eligible", torch.empty(n, dtype=torch.bool), persistent=False)
        self.register_buffer("cap", torch.empty(n, dtype=f64), persistent=False)
        self.register_buffer("work_weight", torch.empty(n, dtype=f64), persistent=False)
        self.register_buffer("threshold", torch.empty(n, dtype=torch.float32))
        self.register_buffer("histogram", torch.empty(n, self.bins, dtype=f64))
        self.register_buffer("correction", torch.empty(n, dtype=f64))
        self.register_buffer("skipping", torch.empty(n, dtype=torch.bool))
        self.register_buffer("tokens_seen", torch.empty((), dtype=f64))
        self.register_buffer("executed_total", torch.empty(n, dtype=f64))
        self.register_buffer("tokens_total", torch.empty((), dtype=f64))
        # this step's counts (training forwards), folded in by update(); padded = attention's B·M query rows
        self.register_buffer("pending", torch.empty(n, len(COUNTS) + self.bins, dtype=f64), persistent=False)
        self.register_buffer("inference", torch.empty(n, len(COUNTS), dtype=f64), persistent=False)
        self._index_1: dict = {}  # device -> [(1,) index of each sublayer] (static_decision's, made once)
        self.reset_buffers()
        self.set_work_weights(work_weights)
        self.last_step: Optional[dict] = None  # the step update() just folded in (see there)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """A fresh calibrator's buffer values: eligibility and ceilings from the constructor, the last work
        weights set, no threshold (EXECUTE_ALL), empty histograms and counters. Also recomputes them after
        meta-device construction (nagmoe/model/init_rng.py)."""
        if self.eligible.is_meta:
            return
        self.eligible.copy_(torch.tensor(self.eligible_list, dtype=torch.bool))
        self.cap.fill_(1.0 if self.max_sublayer_skip is None else float(self.max_sublayer_skip))
        if self.work_weight_list:
            self.work_weight.copy_(torch.tensor(self.work_weight_list, dtype=torch.float64))
        self.threshold.fill_(EXECUTE_ALL)
        for buf in (self.histogram, self.correction, self.skipping, self.tokens_seen, self.executed_total,
                    self.tokens_total, self.pending, self.inference):
            buf.zero_()

    # views of the packed counts (class docstring), by static_decision's columns
    pending_executed = property(lambda self: self.pending[:, 0])
    pending_tokens = property(lambda self: self.pending[:, 1])
    pending_padded = property(lambda self: self.pending[:, 2])
    pending_hist = property(lambda self: self.pending[:, len(COUNTS):])
    inference_executed = property(lambda self: self.inference[:, 0])
    inference_tokens = property(lambda self: self.inference[:, 1])

    def extra_repr(self) -> str:
        return (f"mode={self.mode}, skip_rate={self.skip_rate}, eligible={sum(self.eligible_list)}/"
                f"{self.n_sublayers}, max_sublayer_skip={self.max_sublayer_skip}, p_thres={self.p_thres}, "
                f"start_tokens={self.start_tokens}, bins={self.bins}, decay={self.decay}, "
                f"correction_gain={self.correction_gain}")

    def set_work_weights(self, weights: Optional[Sequence[float]]) -> None:
        """w_l, the skippable work per token of each sublayer (None: 1 each, i.e. token shares); 0 for
        ineligible sublayers."""
        w = [1.0] * self.n_sublayers if weights is None else [float(x) for x in weights]
        if len(w) != self.n_sublayers or min(w) < 0:
            raise ValueError(f"MoDCalibrator: work weights must be {self.n_sublayers} values >= 0, got {weights}")
        self.work_weight_list = [wi if e else 0.0 for wi, e in zip(w, self.eligible_list)]
        if not self.work_weight.is_meta:
            self.work_weight.copy_(torch.tensor(self.work_weight_list, dtype=torch.float64))

    # ------------------------------------------------------------------------------------------------------
    def resolved_impl(self, device) -> str:
        """`model.mod.impl` where the calibrator's buffers live (or on `device`): gather or static."""
        return resolve_mod_impl(self.impl, torch.device(device).type)

    def select(self, index: int, score_BT: torch.Tensor):
        """The executed tokens of sublayer `index` (score > threshold), or None when it runs every token
        (ineligible; with `gather` also before skipping starts). `static` (model.mod.impl) returns an undecided
        `Selection` for every eligible sublayer, before the start too (mask all True): the same graph every
        step; the caller hands it to the sublayer, then to `record`. Training forwards add the scores to this
        step's histogram."""
        if not self.eligible_list[index]:
            return None
        if self.resolved_impl(score_BT.device) == "static":
            return self._select_static(index, score_BT)  # detached in the decision
        score_BT = score_BT.detach()
        mask_BT = score_BT > self.threshold[index]
        # the sublayer's one device->host read: does it skip, how many execute, the most in one sequence (and
        # for attention, the even indices of the transformer, the key ends of its query blocks)
        select = ExecutedTokens(mask_BT, flags=self.skipping[index], queries=index % 2 == 0)
        skipping, n, M = bool(select.flags[0]), select.n, select.M
        executed = n if skipping else score_BT.numel()
        # attention runs executed queries padded to the longest row: B · max_b count_b rows
        self._add_scores(index, score_BT, executed, M * mask_BT.shape[0] if skipping else score_BT.numel())
        return select if skipping else None

    def _select_static(self, index: int, score_BT: torch.Tensor) -> Selection:
        """The static Selection, undecided (no op here): the sublayer makes the decision where it runs, inside its
        compiled unit when compiled (mod.static_decision: the mask with the skip flag applied on the device, the
        counts, the score histogram of a training forward); `record` then adds the counts."""
        return Selection(decision=(score_BT, self.threshold, self.skipping, self._sublayer_index(index), self.bins,
                                   self.training))

    def _sublayer_index(self, index: int) -> torch.Tensor:
        """Sublayer `index` as a (1,) device tensor, made once per device: a compiled unit reads the threshold and
        the skip flag through it, so the one graph of a class serves every sublayer."""
        device = self.threshold.device
        if device not in self._index_1:
            self._index_1[device] = [torch.full((1,), i, device=device) for i in range(self.n_sublayers)]
        return self._index_1[device][index]

    def record(self, index: int, select: Selection) -> None:
        """A static call's counts (its `counts_1P`, decided by then) into this step's counts (a training decision)
        or those of the forwards outside training: one index_add of the call's row."""
        counts_1P = select.counts_1P
        packed = self.pending if counts_1P.shape[1] > len(COUNTS) else self.inference
        packed.index_add_(0, self._sublayer_index(index), counts_1P)

    def _add_scores(self, index: int, score_BT: torch.Tensor, executed, padded) -> None:
        """Gather's counts of sublayer `index` (static's: `record`): the score histogram, tokens, executed tokens
        and padded query rows (python ints or device tensors alike) for training; executed and tokens otherwise."""
        if self.training:
            bin_N = score_bins(score_BT, self.bins)
            hist_K = self.pending_hist[index]  # index_add_, not bincount: no output-size read
            hist_K.index_add_(0, bin_N, torch.ones(bin_N.shape, dtype=hist_K.dtype, device=hist_K.device))
            self.pending_tokens[index] += score_BT.numel()
            self.pending_executed[index] += executed
            self.pending_padded[index] += padded
        else:
            self.inference_tokens[index] += score_BT.numel()
            self.inference_executed[index] += executed

    def pending_counts(self) -> torch.Tensor:
        """This step's counts, packed in one float64 tensor (what `update` all-reduces over ranks): a copy of
        `pending`, rows of (executed, tokens, padded, histogram)."""
        return self.pending.reshape(-1).clone()

    @torch.no_grad()
    def update(self, reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> list[float]:
        """After an optimizer step: sum this step's counts over ranks (`reduce_fn`: all-reduce SUM, or None
        for one process), fold them into the histograms and the correction, set the next step's thresholds
        and return the realised executed fraction of each sublayer in the step just taken (1.0 where nothing
        skipped). `last_step` keeps {"executed", "padded" (attention's padded query rows per token),
        "skipping" (did any sublayer skip), "tokens"} of that step for the trainer's accounting."""
        n, K = self.n_sublayers, self.bins
        packed = self.pending_counts()
        if reduce_fn is not None:  # an all-reduce SUM, in place or returning the sum
            reduced = reduce_fn(packed)
            packed = packed if reduced is None else reduced
        counts_nP = packed.view(n, len(COUNTS) + K)
        executed_n, tokens_n, padded_n = counts_nP[:, :len(COUNTS)].unbind(1)
        hist_nK = counts_nP[:, len(COUNTS):]
        step_tokens = tokens_n.max()  # every eligible sublayer sees every token; others record nothing
        counted_n = self.eligible & (tokens_n > 0)
        fractions_n = torch.where(counted_n, executed_n / tokens_n.clamp_min(1), torch.ones_like(executed_n))
        padded_frac_n = torch.where(counted_n, padded_n / tokens_n.clamp_min(1), torch.ones_like(padded_n))
        was_skipping = (self.skipping & (tokens_n > 0)).any()
        self.executed_total += fractions_n * step_tokens
        self.tokens_total += step_tokens
        self.tokens_seen += step_tokens
        self.histogram.mul_(self.decay).add_(hist_nK)
        self._control(fractions_n, self.skipping & (tokens_n > 0))
        self._set_thresholds(self.skip_rate + self.correction)
        started = self.tokens_seen >= self.start_tokens
        self.skipping.copy_(self.eligible & (self.histogram.sum(1) > 0) & started & (self.skip_rate > 0))
        self.pending.zero_()
        summary = torch.cat([fractions_n, padded_frac_n, was_skipping.double().view(1),
                             step_tokens.view(1)]).tolist()  # the step's one device->host read
        self.last_step = {"executed": summary[:n], "padded": summary[n:2 * n], "skipping": bool(summary[2 * n]),
                          "tokens": summary[2 * n + 1]}
        return self.last_step["executed"]

    def _control(self, fractions_n: torch.Tensor, active_n: torch.Tensor) -> None:
        """Integral control of the realised skip (the quantity the mode targets), on skipping sublayers."""
        if self.mode == "fixed":
            return
        if self.mode == "per_sublayer":
            error_n = self.skip_rate - (1.0 - fractions_n)
        else:  # global: one error, the work-weighted skip of the step, in every entry
            w_n = self.work_weight * active_n
            error = self.skip_rate - (w_n * (1.0 - fractions_n)).sum() / w_n.sum().clamp_min(1e-300)
            error_n = error.expand(self.n_sublayers)
        self.correction.add_(torch.where(active_n, self.correction_gain * error_n, torch.zeros_like(error_n)))
        self.correction.clamp_(-self.skip_rate, 0.99 - self.skip_rate)

    def _set_thresholds(self, level_n: torch.Tensor, mode: Optional[str] = None) -> None:
        """Thresholds of the next forwards for a target `level_n` (n,) (global: its eligible entries agree)."""
        mode = mode or self.mode
        if mode == "per_sublayer":
            q_n = histogram_quantile(self.histogram, torch.minimum(level_n, self.cap))
        else:
            if mode == "fixed":
                q_n = torch.full_like(self.correction, float(self.p_thres))
            else:  # the eligible entries of level_n agree (global mode): take the first one's, 0 with none
                first = self.eligible_list.index(True) if any(self.eligible_list) else None
                level = level_n[first] if first is not None else 0.0
                q_n = global_threshold(self.histogram, self.work_weight, self.cap, level).expand_as(self.correction)
            if self.max_sublayer_skip is not None:  # each sublayer's ceiling as a threshold: Q_l(c_l)
                q_n = torch.minimum(q_n, histogram_quantile(self.histogram, self.cap))
        self.threshold.copy_(torch.where(self.eligible, q_n, torch.full_like(q_n, EXECUTE_ALL)).to(self.threshold))

    @torch.no_grad()
    def set_skip_rate(self, rate: float, level=None) -> None:
        """The compute dial after training: thresholds for skip rate `rate` from the saved histograms at the
        histogram level `level` (default `rate`; a float, or one per sublayer in per_sublayer mode), no
        correction (the scores no longer drift); 0 runs every token. A `fixed`-mode model is dialled with the
        global rule (a dial asks for a rate, not a threshold). Skipping starts at once."""
        if not 0.0 <= rate < 1.0:
            raise SkipRateUnavailable(f"{rate} must be in [0, 1)")
        calibrated = self.histogram.sum(1) > 0
        if rate > 0 and not bool(calibrated[self.eligible].all()):
            raise SkipRateUnavailable("this model has no score histograms yet (it was never trained with MoD)")
        self.skip_rate = float(rate)
        self.correction.zero_()
        level_n = torch.as_tensor(rate if level is None else level, dtype=torch.float64,
                                  device=self.correction.device).expand(self.n_sublayers).clone()
        self._set_thresholds(level_n.clamp(0.0, 0.99), "global" if self.mode == "fixed" else self.mode)
        self.skipping.copy_(self.eligible & calibrated & (rate > 0))

    # ------------------------------------------------------------------------------------------------------
    def run_executed_fractions(self) -> list[float]:
        """Token-weighted executed fraction per sublayer over every step so far (1.0 before any step)."""
        if float(self.tokens_total) == 0:
            return [1.0] * self.n_sublayers
        return (self.executed_total / self.tokens_total).tolist()

    def token_skip_rate(self, fractions: Sequence[float]) -> float:
        """1 − the mean executed fraction over the eligible sublayers (every sublayer's token share alike)."""
        return realised_skip_rate(fractions, self.eligible_list)

    def skip_rate_of(self, fractions: Sequence[float]) -> float:
        """The skipped share of the skippable work over the eligible sublayers (the quantity model.mod.skip_rate
        targets in global mode); the weights are the python copy: no device read per call."""
        return realised_skip_rate(fractions, self.eligible_list, self.work_weight_list)

    def work_shares(self, fractions: Sequence[float]) -> list[float]:
        """Per sublayer, its skipped work as a share of all skippable work (they sum to skip_rate_of)."""
        w = self.work_weight_list
        total = sum(wi for wi, e in zip(w, self.eligible_list) if e)
        return [wi * (1.0 - f) / total if e else 0.0 for wi, f, e in zip(w, fractions, self.eligible_list)]

    def reset_inference_counts(self) -> None:
        self.inference.zero_()

    def inference_fractions(self) -> Optional[list[float]]:
        """Executed fraction per sublayer of the forwards outside training so far (None before any)."""
        tokens = self.inference_tokens
        if float(tokens.max()) == 0:
            return None
        return (self.inference_executed / tokens.clamp_min(1)).where(tokens > 0, torch.ones_like(tokens)).tolist()

    def inference_skip_rate(self) -> Optional[float]:
        """Realised (work-weighted) skip rate of the forwards outside training so far (None before any)."""
        fractions = self.inference_fractions()
        return None if fractions is None else self.skip_rate_of(fractions)


DIAL_PASSES = 4  # fixed-point passes of the dial's calibration
DIAL_TOLERANCE = 0.002  # stop calibrating once the realised rate is this close


def mod_calibrator(model):
    """The model's MoDCalibrator, or None (no MoD in this model, or a model without the MoD API)."""
    getter = getattr(model, "mod_calibrator", None)
    return getter() if callable(getter) else None


def calibrate_skip_rate(model, rate: float, run_forwards: Callable[[], None], passes: int = DIAL_PASSES) -> dict:
    """Thresholds that realise skip rate `rate` on the tokens `run_forwards()` feeds the model (eval-mode
    forwards): the histogram quantiles of the saved scores at level ℓ (ℓ_0 = rate) miss it, because scores
    outside training differ from the decayed training histograms; a few fixed-point passes
    ℓ <- ℓ + (rate − realised(ℓ)) correct that (per sublayer in per_sublayer mode, where each sublayer
    targets its own token share; the work-weighted skip otherwise). The model keeps the last measured
    thresholds. Returns {"requested", "calibrated" (realised on the calibration tokens), "level", "passes"}."""
    cal = mod_calibrator(model)
    per_sublayer = cal.mode == "per_sublayer"
    level = [rate] * cal.n_sublayers if per_sublayer else rate
    realised = 0.0
    for done in range(1, passes + 1):
        model.set_mod_skip_rate(rate, level)
        if rate == 0:
            break
        cal.reset_inference_counts()
        run_forwards()
        executed = cal.inference_fractions() or [1.0] * cal.n_sublayers
        realised = cal.skip_rate_of(executed)
        if done == passes or abs(realised - rate) <= DIAL_TOLERANCE:
            break
        if per_sublayer:
            level = [min(0.99, max(0.0, lv + rate - (1.0 - f))) for lv, f in zip(level, executed)]
        else:
            level = min(0.99, max(0.0, level + rate - realised))
    cal.reset_inference_counts()
    return {"requested": float(rate), "calibrated": realised, "level": level, "passes": done}
