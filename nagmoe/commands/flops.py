"""`nagmoe flops --config PATH [--executed F]`: training FLOPs per token by part and in both FLOP conventions
(matmul, non_embedding), for MoD the ideal token ratio against full depth, F(executed=1) / F(executed), in
each, and the skip rate that would give the paper's x1.218 in each."""
import json

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.base.errors import UserError, shown


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--executed", type=float, default=None,
                   help="executed fraction of every sublayer (default: 1 - model.mod.skip_rate)")
    p.add_argument("--run-dir", default=None, help="use a run's realised executed fractions (summary.json)")


def _executed(args, cfg):
    if args.run_dir is not None:
        import os

        from nagmoe.rundir.info import read_summary
        from nagmoe.rundir.names import SUMMARY_FILE

        summary = read_summary(args.run_dir)  # the fields used here checked (a bad one: UserError)
        if summary is None:
            raise UserError(f"{shown(os.path.join(args.run_dir, SUMMARY_FILE))}: no {SUMMARY_FILE} in the run dir")
        fr = summary.get("executed_fractions")
        if fr is None:
            skip = float(summary.get("skip_rate") or 0.0)
            return 1.0 - skip
        return fr
    if args.executed is not None:
        if not 0.0 < args.executed <= 1.0:
            raise UserError(f"--executed: {args.executed} must be in (0, 1]")
        return args.executed
    return 1.0 - cfg.model.mod.skip_rate


def run(args) -> int:
    from nagmoe.config.flops import (CONVENTIONS, PAPER_MOD_TOKEN_RATIO, convention_total, forward_flops_per_token,
                              mod_token_ratio, skip_for_token_ratio)

    cfg = config_from_args(args)
    T = cfg.data.seq_len
    executed = _executed(args, cfg)
    forward = forward_flops_per_token(cfg.model, T, executed)
    full_forward = forward_flops_per_token(cfg.model, T, 1.0)
    parts = {k: 3.0 * v for k, v in forward.items()}
    chosen = cfg.train.flop_convention
    conventions = {c: {"training_flops_per_token": 3.0 * convention_total(forward, c),
                       "full_depth_flops_per_token": 3.0 * convention_total(full_forward, c),
                       "ideal_token_ratio": mod_token_ratio(cfg.model, T, executed, c),
                       "skip_rate_for_paper_ratio": skip_for_token_ratio(cfg.model, T, PAPER_MOD_TOKEN_RATIO, c)}
                   for c in CONVENTIONS}
    out = {"seq_len": T, "training_flops_per_token": parts, "flop_convention": chosen, "conventions": conventions,
           "full_depth_flops_per_token": conventions[chosen]["full_depth_flops_per_token"],
           "ideal_token_ratio": conventions[chosen]["ideal_token_ratio"], "paper_token_ratio": PAPER_MOD_TOKEN_RATIO}
    if cfg.train.flop_budget:
        out["budget_tokens"] = cfg.train.flop_budget / conventions[chosen]["training_flops_per_token"]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"training FLOPs per token (forward + backward), seq_len {T}, by part:")
    for k, v in parts.items():
        print(f"  {k:<18} {v:>16,.0f}")
    print("by convention (matmul: analytic matmul FLOPs, full T x T attention, no elementwise work; non_embedding: "
          "the same without the unembedding):")
    for c, v in conventions.items():
        skip = v["skip_rate_for_paper_ratio"]
        mark = "  <- train.flop_convention" if c == chosen else ""
        print(f"  {c:<14} {v['training_flops_per_token']:>16,.0f} FLOPs/token; ideal token ratio vs full depth "
              f"{v['ideal_token_ratio']:.4f}; x{PAPER_MOD_TOKEN_RATIO:.3f} (the paper's 60.9B/50B) needs "
              f"{'no reachable skip rate' if skip is None else f'{skip:.1%} of the skippable work skipped'}{mark}")
    if "budget_tokens" in out:
        print(f"tokens in train.flop_budget ({chosen}): {out['budget_tokens']:,.0f}")
    return 0
