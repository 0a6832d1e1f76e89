"""`nagmoe params --config PATH`: parameter counts; `--solve` picks a layout for target counts."""
import json

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.config import dump_yaml
from nagmoe.errors import UserError


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--solve", action="store_true", help="solve a layout for --total/--active/--ratio")
    p.add_argument("--total", type=float, default=900e6)
    p.add_argument("--active", type=float, default=150e6)
    p.add_argument("--ratio", type=float, default=40.0, help="width-to-depth ratio d_model / n_layers")


def _fmt(n: float) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e5 else f"{int(n):,}"


def run(args) -> int:
    from nagmoe.flops import param_counts

    cfg = config_from_args(args)
    if args.solve:
        from nagmoe.layout_solver import solve_layout

        if min(args.total, args.active, args.ratio) <= 0 or args.active > args.total:
            raise UserError("--solve needs 0 < --active <= --total and --ratio > 0")
        lay = solve_layout(cfg.model, args.total, args.active, args.ratio)
        cfg.model = lay.model
        info = {"total": lay.total, "active": lay.active, "ratio": lay.ratio, "max_rel_error": lay.error}
        if args.json:
            print(json.dumps({**info, "model": json.loads(json.dumps(cfg.model.__dict__, default=vars))}))
        else:
            print(f"# solved: total {_fmt(lay.total)}, active {_fmt(lay.active)}, width/depth {lay.ratio:.1f}, "
                  f"max error {lay.error:.2%}")
            print(dump_yaml(cfg).split("data:")[0], end="")
        return 0
    counts = param_counts(cfg.model)
    if args.json:
        print(json.dumps(counts))
        return 0
    width = max(len(k) for k in counts)
    for k, v in counts.items():
        print(f"{k:<{width}}  {v:>14,}  {_fmt(v):>10}")
    return 0
