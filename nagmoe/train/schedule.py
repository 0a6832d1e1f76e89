"""Learning-rate multiplier (nanochat style) and the NAG injection warm-up factor.

The multiplier scales every group's `initial_lr`:

    warm-up   w(step)     = min(1, (step + 1) / warmup_steps)                 (always counted in steps)
    progress  p           = flops_done / flop_budget   when train.flop_budget is set
                          = step / schedule_steps       otherwise
    warm-down d(p)        = 1                                    for p <= 1 - warmdown_frac
                          = f + (1 - f) * (1 - p) / warmdown_frac  after that, f = final_lr_frac
                          = f                                    for p >= 1
    multiplier            = min(w(step), d(p))

One horizon only: with a FLOP budget, max_steps is just a stop, so a MoD run that gets more (cheaper) steps
for the same budget still anneals over its whole budget. Taking the min lets a very short run whose
warm-down reaches into the warm-up stay continuous.
"""
from __future__ import annotations

from typing import Optional


def schedule_progress(step: int, flops_done: Optional[float], train_cfg) -> float:
    """Fraction of the LR horizon done before this step: FLOPs / flop_budget if set, else step / schedule_steps."""
    if train_cfg.flop_budget is not None:
        if flops_done is None:
            raise ValueError("lr schedule: train.flop_budget is set, so flops_done is required")
        return float(flops_done) / float(train_cfg.flop_budget)
    return step / train_cfg.schedule_steps


def lr_multiplier(step: int, flops_done: Optional[float], train_cfg) -> float:
    """LR multiplier for 0-based optimizer step `step`, with `flops_done` training FLOPs spent before it."""
    warmup = 1.0 if train_cfg.warmup_steps <= 0 else min(1.0, (step + 1) / train_cfg.warmup_steps)
    progress = schedule_progress(step, flops_done, train_cfg)
    final, frac = train_cfg.final_lr_frac, train_cfg.warmdown_frac
    if progress >= 1.0:
        warmdown = final
    elif frac <= 0.0 or progress <= 1.0 - frac:
        warmdown = 1.0
    else:
        warmdown = final + (1.0 - final) * (1.0 - progress) / frac
    return min(warmup, warmdown)


def injection_warmup(tokens_seen: float, warmup_tokens: float) -> float:
    """NAG injection warm-up factor min(1, tokens_seen / warmup_tokens); 1.0 when warmup_tokens == 0."""
    if warmup_tokens <= 0:
        return 1.0
    return min(1.0, max(0.0, tokens_seen / warmup_tokens))
