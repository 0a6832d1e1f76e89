"""Mixture-of-Depths readings: the realised skip rate per sublayer, and the post-training compute dial (validation
loss and executed FLOPs when inference skips 0, 10, 20, 30, 40% of the eligible sublayer work).

This module only *reads* MoD (nagmoe/model/mod_calibration.py owns it), through three names:
- `Transformer.mod_calibrator()`: the stream's `MoDCalibrator` (eligible sublayers, work weights, target, the
  counters of eval-mode forwards), or None for a model trained without MoD;
- `Transformer.set_mod_skip_rate(rate, level)`: thresholds from the saved score histograms;
- `ModelOutput.stats["executed_frac"]` (`EXECUTED_KEY`): per sublayer, the fraction of tokens that executed it
  in that forward (1 where MoD does not apply).
Without MoD the JSON says "not available" with a note. The realised skip rate is the skipped share of the
eligible sublayers' work (work weights: the FLOP accounting's skippable FLOPs per sublayer), the quantity
`model.mod.skip_rate` targets; the plain token mean is reported beside it.

The dial is exact: each rate is calibrated by a few fixed-point passes on calibration tokens
(`calibrate_skip_rate`), then measured on other tokens; requested vs realised are both in its rows.
Executed FLOPs are inference (forward) FLOPs per token, `nagmoe.config.flops.forward_flops_per_token(model_cfg, seq_len,
executed=realised fractions)["total"]`, so K/V, embeddings, unembedding and gates stay paid for skipped tokens.
`run_dial` restores the calibrator's saved state (the trained thresholds) afterwards.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from nagmoe.model.mod_calibration import (  # the one skip-rate rule (the calibrator uses it too)
    calibrate_skip_rate, mod_calibrator, realised_skip_rate)

DIAL_RATES = (0.0, 0.1, 0.2, 0.3, 0.4)
EXECUTED_KEY = "executed_frac"
NOT_AVAILABLE = "not available"


def mod_section(stats: dict, model=None) -> object:
    """Realised skip rate per sublayer from averaged stats (plus the target, eligibility and the training run's
    totals when the model carries a calibrator), or NOT_AVAILABLE."""
    executed = stats.get(EXECUTED_KEY)
    if executed is None:
        return NOT_AVAILABLE
    calibrator = mod_calibrator(model) if model is not None else None
    eligible = list(calibrator.eligible_list) if calibrator is not None else None
    weights = list(calibrator.work_weight_list) if calibrator is not None else None
    out = {"skip_rate_per_sublayer": [1.0 - e for e in executed], "executed_frac_per_sublayer": executed,
           "realised_skip_rate": realised_skip_rate(executed, eligible, weights),
           "realised_skip_rate_tokens": realised_skip_rate(executed, eligible)}
    if "score_mean" in stats:
        out["rotation_score_mean_per_sublayer"] = stats["score_mean"]
    if calibrator is not None:
        out["eligible"] = eligible
        out["target_skip_rate"] = calibrator.skip_rate
        summary = model.mod_summary() if hasattr(model, "mod_summary") else None
        if summary is not None:
            out["training_skip_rate"] = summary["skip_rate"]
            out["training_executed_frac_per_sublayer"] = summary["executed_fractions"]
    return out


def executed_flops_per_token(model_cfg, seq_len: int, executed: Optional[list]) -> float:
    """Forward (inference) FLOPs per token with the given executed fractions (None = full depth)."""
    from nagmoe.config.flops import forward_flops_per_token

    return forward_flops_per_token(model_cfg, seq_len, executed)["total"]


def compute_dial(model, model_cfg, seq_len: int, evaluate: Callable[[], tuple[float, Optional[float], dict]],
                 set_skip_rate: Callable, rates: Iterable[float] = DIAL_RATES,
                 eligible: Optional[Sequence[bool]] = None, weights: Optional[Sequence[float]] = None) -> list[dict]:
    """For each rate: `set_skip_rate(model, rate)` (which may return its calibration, a dict), then
    `evaluate() -> (val_loss, val_bpb, averaged stats)`; report the loss, bpb, the realised (work-weighted)
    skip rate and executed fraction per sublayer, and the executed forward FLOPs per token (also relative to
    full depth)."""
    full = executed_flops_per_token(model_cfg, seq_len, None)
    rows = []
    for rate in rates:
        calibration = set_skip_rate(model, float(rate))
        loss, bpb, stats = evaluate()
        executed = stats.get(EXECUTED_KEY)
        flops = executed_flops_per_token(model_cfg, seq_len, executed)
        rows.append({"skip_rate": float(rate), "val_loss": loss, "val_bpb": bpb,
                     "realised_skip_rate": realised_skip_rate(executed, eligible, weights) if executed else None,
                     "executed_frac_per_sublayer": executed, "forward_flops_per_token": flops,
                     "flops_vs_full_depth": flops / full,
                     **({"calibrated_skip_rate": calibration["calibrated"], "calibration_passes": calibration["passes"]}
                        if isinstance(calibration, dict) else {})})
    return rows


def run_dial(model, seq_len: int, evaluate: Callable, rates: Iterable[float] = DIAL_RATES,
             calibrate_forwards: Optional[Callable[[], None]] = None) -> object:
    """The dial of a MoD model (NOT_AVAILABLE without a calibrator), leaving its trained thresholds in place.
    With `calibrate_forwards` (forwards on tokens other than those `evaluate` measures) each rate is
    calibrated first (`calibrate_skip_rate`), so the realised rate on the evaluated tokens is the asked one."""
    calibrator = mod_calibrator(model)
    if calibrator is None:
        return NOT_AVAILABLE
    saved = {k: v.clone() for k, v in calibrator.state_dict().items()}
    saved_rate = calibrator.skip_rate
    try:
        set_rate = ((lambda m, r: calibrate_skip_rate(m, r, calibrate_forwards)) if calibrate_forwards is not None
                    else (lambda m, r: m.set_mod_skip_rate(r)))
        return compute_dial(model, model.config, seq_len, evaluate, set_rate, rates, calibrator.eligible_list,
                            list(calibrator.work_weight_list))
    finally:
        calibrator.load_state_dict(saved)
        calibrator.skip_rate = saved_rate
