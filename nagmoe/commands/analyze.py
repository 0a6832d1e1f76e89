"""`nagmoe analyze --run-dir DIR --out FILE.json [--tokens N] [--batch-rows B] [--bins K] [--milestones]`: depth statistics
(norm, rotation, NAG gates), attention to BOS per layer, confidence bins, MoD skip rates and the compute dial of
a run's latest valid checkpoint on BOS-aligned validation windows, written as JSON (`nagmoe/analysis/`).
Prints a few headline numbers."""
from __future__ import annotations

import json
import os

from nagmoe.base.errors import UserError


def add_arguments(p):
    p.add_argument("--run-dir", required=True, help="a training run dir (config.yaml + checkpoints/)")
    p.add_argument("--out", required=True, metavar="FILE.json", help="where to write the analysis")
    p.add_argument("--tokens", type=int, default=16384, metavar="N", help="validation tokens to analyse")
    p.add_argument("--batch-rows", type=int, default=8, metavar="B", help="windows per forward")
    p.add_argument("--bins", type=int, default=10, metavar="K", help="confidence bins")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--milestones", action="store_true",
                   help="also measure every milestone (train.keep_milestone_every_tokens: weights-only under "
                        "milestones/, or full checkpoints): norm, rotation, skip and router health through "
                        "training, under `through_training`")


def _fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def run(args) -> int:
    from nagmoe.analysis.run_analysis import analyze_run
    from nagmoe.commands.eval import resolve_device
    from nagmoe.base.files import atomic_writer
    from nagmoe.rundir.metrics import plain_json

    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UserError(f"--out: directory {out_dir} does not exist")
    device = resolve_device(args.device)
    result = analyze_run(args.run_dir, device, args.tokens, args.batch_rows, args.bins)
    if args.milestones:
        from nagmoe.analysis.run_analysis import analyze_milestones

        result["through_training"] = analyze_milestones(args.run_dir, device, args.tokens, args.batch_rows)
    with atomic_writer(args.out) as f:  # nagmoe.base.files: a half-written or linked-through --out never happens
        json.dump(plain_json(result), f, indent=2)
    depth, sink = result["depth"], result["attention_sink"]
    print(f"{result['residual']} run, {result['tokens']} tokens: val loss {_fmt(result['val_loss'], '.4f')}, "
          f"bpb {_fmt(result['val_bpb'], '.4f')}")
    print(f"norm growth through depth ({depth['norm_curve_kind']}): x{_fmt(depth['norm_growth'])}; cumulative "
          f"rotation {depth['cumulative_rotation'][-1]:.3f} rad")
    print(f"attention on BOS: mean {_fmt(sink['mean_first_key_mass'])}, layers above 50%: "
          f"{sink['layers_above_half']}/{sink['n_layers']}")
    for name, rep in result["confidence"].items():
        print(f"confidence by {name}: spearman vs loss {_fmt(rep['spearman_loss'])}, "
              f"vs top-1 {_fmt(rep['spearman_top1'])}")
    print(f"mod: {'see JSON' if isinstance(result['mod'], dict) else result['mod']}; compute dial: "
          f"{'see JSON' if isinstance(result['compute_dial'], list) else result['compute_dial']}")
    for row in result.get("through_training", []):
        print(f"step {row['step']}{' (milestone)' if row['milestone'] else ''}: val loss {_fmt(row['val_loss'], '.4f')}, "
              f"norm growth x{_fmt(row['norm_growth'])}, rotation {_fmt(row['cumulative_rotation'])} rad, skip "
              f"{_fmt(row['skip_rate'])}, worst expert load x{_fmt(row['router_max_over_mean'], '.2f')}")
    print(f"wrote {args.out}")
    return 0
