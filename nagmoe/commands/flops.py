"""`nagmoe flops --config PATH [--executed F]`: training FLOPs per token by part, and for MoD the ideal token
ratio against full depth, F(executed=1) / F(executed)."""
import json

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.errors import UserError


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--executed", type=float, default=None,
                   help="executed fraction of every sublayer (default: 1 - model.mod.skip_rate)")
    p.add_argument("--run-dir", default=None, help="use a run's realised executed fractions (summary.json)")


def _executed(args, cfg):
    if args.run_dir is not None:
        import os

        path = os.path.join(args.run_dir, "summary.json")
        if not os.path.isfile(path):
            raise UserError(f"{path}: no summary.json in the run dir")
        with open(path) as f:
            summary = json.load(f)
        fr = summary.get("executed_fractions")
        if fr is None:
            skip = float(summary.get("skip_rate", 0.0))
            return 1.0 - skip
        return fr
    if args.executed is not None:
        if not 0.0 < args.executed <= 1.0:
            raise UserError(f"--executed: {args.executed} must be in (0, 1]")
        return args.executed
    return 1.0 - cfg.model.mod.skip_rate


def run(args) -> int:
    from nagmoe.flops import flops_per_token, forward_flops_per_token, mod_token_ratio

    cfg = config_from_args(args)
    T = cfg.data.seq_len
    executed = _executed(args, cfg)
    parts = {k: 3.0 * v for k, v in forward_flops_per_token(cfg.model, T, executed).items()}
    full = flops_per_token(cfg.model, T, 1.0)
    out = {"seq_len": T, "training_flops_per_token": parts, "full_depth_flops_per_token": full,
           "ideal_token_ratio": mod_token_ratio(cfg.model, T, executed)}
    if cfg.train.flop_budget:
        out["budget_tokens"] = cfg.train.flop_budget / parts["total"]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"training FLOPs per token (forward + backward), seq_len {T}:")
    for k, v in parts.items():
        print(f"  {k:<18} {v:>16,.0f}")
    print(f"ideal token ratio vs full depth: {out['ideal_token_ratio']:.4f}")
    if "budget_tokens" in out:
        print(f"tokens in train.flop_budget: {out['budget_tokens']:,.0f}")
    return 0
