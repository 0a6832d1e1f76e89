"""`nagmoe params --config PATH`: parameter counts; `--solve` picks a layout for target counts (`--experts E
--top-k K` fixes the experts, as the controlled sweep does); `--check` exits 1 when the config's active or total
count is outside the tolerance of the targets (5% active, 10% total; the NAG model and its pre-norm twin)."""
import json

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.config import dump_yaml
from nagmoe.base.errors import UserError


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--solve", action="store_true", help="solve a layout for --total/--active/--ratio")
    p.add_argument("--total", type=float, default=900e6)
    p.add_argument("--active", type=float, default=150e6)
    p.add_argument("--ratio", type=float, default=40.0, help="width-to-depth ratio d_model / n_layers")
    p.add_argument("--experts", type=int, default=None, help="--solve: this n_experts only")
    p.add_argument("--top-k", type=int, default=None, help="--solve: this top_k only")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless active is within --active-tolerance and total within --total-tolerance")
    p.add_argument("--active-tolerance", type=float, default=0.05)
    p.add_argument("--total-tolerance", type=float, default=0.10)
    p.add_argument("--memory", action="store_true", help="bytes per rank of a training layout (nagmoe/train/memory.py)")
    p.add_argument("--ep", type=int, default=None, help="--memory: expert-parallel degree (default parallel.ep)")
    p.add_argument("--world-size", type=int, default=None, help="--memory: ranks (default: --ep)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="--memory: tokens per rank per micro-step (default train.micro_batch_tokens)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="--memory: cuda (bf16 autocast, CUDA context) or cpu (fp32, what tests check against RSS)")
    p.add_argument("--cuda-rules", default=None, metavar="TORCH_VERSION",
                   help="--memory --device cuda: the activations under CUDA's autocast rules of this torch version "
                        "(the cluster's; default NAGMOE_CUDA_RULES, else the installed torch's)")


def _fmt(n: float) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e5 else f"{int(n):,}"


def run(args) -> int:
    from nagmoe.config.flops import param_counts

    cfg = config_from_args(args)
    if args.solve:
        from nagmoe.config.shape_solver import solve_layout

        if min(args.total, args.active, args.ratio) <= 0 or args.active > args.total:
            raise UserError("--solve needs 0 < --active <= --total and --ratio > 0")
        fixed = {}
        if args.experts is not None or args.top_k is not None:
            if (args.experts or 1) < 1 or (args.top_k or 1) < 1:
                raise UserError("--experts and --top-k must be >= 1")
            fixed = {"experts": (args.experts,) if args.experts else (8, 16, 24, 32, 48, 64, 96, 128),
                     "top_ks": (args.top_k,) if args.top_k else (1, 2, 4, 8),
                     "total_tolerance": args.total_tolerance, "active_tolerance": args.active_tolerance}
        try:
            lay = solve_layout(cfg.model, args.total, args.active, args.ratio, **fixed)
        except ValueError as e:
            raise UserError(f"--solve: {e}") from None
        cfg.model = lay.model
        info = {"total": lay.total, "active": lay.active, "ratio": lay.ratio, "max_rel_error": lay.error}
        if args.json:
            print(json.dumps({**info, "model": json.loads(json.dumps(cfg.model.__dict__, default=vars))}))
        else:
            print(f"# solved: total {_fmt(lay.total)}, active {_fmt(lay.active)}, width/depth {lay.ratio:.1f}, "
                  f"max error {lay.error:.2%}")
            print(dump_yaml(cfg).split("data:")[0], end="")
        return 0
    if args.memory:
        return _memory(cfg, args)
    counts = param_counts(cfg.model)
    if args.check:
        return _check(cfg.model, args)
    if args.json:
        print(json.dumps(counts))
        return 0
    width = max(len(k) for k in counts)
    for k, v in counts.items():
        print(f"{k:<{width}}  {v:>14,}  {_fmt(v):>10}")
    return 0


def _check(model, args) -> int:
    """Exit 0 when both residuals' active and total counts are within the tolerances of the targets, else 1."""
    import copy

    from nagmoe.config.flops import param_counts

    if min(args.active_tolerance, args.total_tolerance) < 0:
        raise UserError("--active-tolerance and --total-tolerance must be >= 0")
    ok = True
    for residual in ("nag", "prenorm"):
        twin = copy.deepcopy(model)
        twin.residual = residual
        c = param_counts(twin)
        for key, target, tol in (("active", args.active, args.active_tolerance),
                                 ("total", args.total, args.total_tolerance)):
            err = c[key] / target - 1
            inside = abs(err) <= tol
            ok &= inside
            print(f"{residual:<8} {key:<6} {_fmt(c[key]):>10} vs {_fmt(target)}: {err:+.1%} "
                  f"({'ok' if inside else 'OUTSIDE'} ±{tol:.0%})")
    return 0 if ok else 1


def _memory(cfg, args) -> int:
    from nagmoe.train.memory import estimate_memory, format_memory

    for flag in ("ep", "world_size", "micro_batch_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')}: {value} must be >= 1")
    ep = args.ep or cfg.parallel.ep
    if cfg.model.ffn == "moe" and cfg.model.moe.n_experts % ep:
        raise UserError(f"--ep: {ep} does not divide model.moe.n_experts={cfg.model.moe.n_experts}")
    if args.cuda_rules is not None and args.device != "cuda":
        raise UserError("--cuda-rules: only with --device cuda (a CPU run takes NAGMOE_CUDA_RULES)")
    est = estimate_memory(cfg, ep, args.micro_batch_tokens, args.device, args.world_size, rules=args.cuda_rules)
    print(json.dumps(est) if args.json else format_memory(est))
    return 0
