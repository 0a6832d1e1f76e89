"""Published numbers the report shows beside ours, always labelled as theirs (source: the project's reading of
the paper and of the reimplementation's write-up, `shared/reference/nag.md`, "Reported results to compare
against"). Their runs are orders of magnitude larger than a CPU demo: the report shows them for direction,
not as a target a small run should hit.
"""
from __future__ import annotations

PAPER = ("paper: Figliolia & Millidge, \"Scaling Adaptive Depth with Norm-Agnostic Residual Networks\" "
         "(Zyphra, arXiv 2606.16112); MoE ~150M active / ~900M total, 50B tokens")
REIMPLEMENTATION = ("seed write-up: public reimplementation AlxSp/nag-nanochat; dense, 64 blocks x 640, ~10B tokens, "
                    "FLOP-matched, no MoD")

# key -> (what is measured, their numbers as text, source)
THEIRS = {
    "nag_loss_advantage": ("NAG loss advantage over the pre-norm baseline (nats)",
                           "~0.012 at width/depth 80, growing to ~0.028 at width/depth 20", PAPER),
    "val_bpb": ("validation bpb, baseline vs NAG", "0.7503 vs 0.7589 (NAG higher bpb at equal FLOPs)",
                REIMPLEMENTATION),
    "core": ("CORE score, baseline vs NAG", "0.2225 vs 0.2373", REIMPLEMENTATION),
    "bos_mass": ("mean attention on the BOS key (key 0)", "62.5% (baseline) -> 46.5% (NAG)", REIMPLEMENTATION),
    "bos_layers": ("layers with > 50% of their attention on BOS", "59/64 (baseline) -> 27/64 (NAG)",
                   REIMPLEMENTATION),
    "norm_growth": ("residual norm through depth", "baseline grows steeply (BOS outlier spike at the end); NAG "
                    "controlled; NAG's cumulative rotation near-linear in depth", REIMPLEMENTATION),
    "confidence": ("final norm vs loss (NAG)", "higher final norm -> lower loss and higher top-1 accuracy",
                   REIMPLEMENTATION),
    "mod_tokens": ("MoD 20% under the full-depth FLOP budget: tokens seen", "60.9B vs 50B (x1.218)", PAPER),
    "mod_loss": ("MoD 20%: final loss behind full-depth NAG", "0.00055 nats", PAPER),
    "nag_cost": ("NAG speed vs baseline (unfused)", "~40% slower, ~24% more memory", REIMPLEMENTATION),
}

# The paper's claims a paired comparison is placed against (nats per token; report_paired.py): the smallest of each.
CLAIMS = {
    "nag_vs_baseline": (0.012, "the paper's smallest NAG advantage, 0.012 nats at width/depth 80"),
    "mod_vs_full": (0.00055, "the paper's MoD-20% loss gap to full depth, +0.00055 nats"),
}
