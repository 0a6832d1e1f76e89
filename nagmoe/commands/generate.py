"""`nagmoe generate --run-dir DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S
--skip-rate R]`: sample a completion from a run's latest valid checkpoint (prefill, then one token at a time
with the inference cache). Prints the prompt followed by the completion on stdout. A MoD run uses its trained
thresholds; `--skip-rate` picks thresholds for another rate from its score histograms (the compute dial),
and the realised skip rate is reported on stderr."""
from __future__ import annotations

from nagmoe.base.errors import UserError


def add_arguments(p):
    p.add_argument("--run-dir", required=True, help="a training run dir (config.yaml + checkpoints/)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, metavar="K", help="sample among the K likeliest (0 = all)")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--skip-rate", type=float, default=None, metavar="R",
                   help="MoD runs: skip this fraction of eligible sublayer work (default: the trained thresholds)")


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: {args.max_new_tokens} must be >= 1")
    if not args.temperature >= 0:
        raise UserError(f"--temperature: {args.temperature} must be >= 0")
    if args.top_k < 0:
        raise UserError(f"--top-k: {args.top_k} must be >= 0 (0 = no top-k)")
    if args.skip_rate is not None and not 0.0 <= args.skip_rate < 1.0:
        raise UserError(f"--skip-rate: {args.skip_rate} must be in [0, 1)")

    import torch

    from nagmoe.eval.generate import generate_text, load_run, mod_report, set_skip_rate

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for but no CUDA device is visible")
    run_ = load_run(args.run_dir, device)
    dial = None
    if args.skip_rate is not None:
        from nagmoe.model.mod_calibration import SkipRateUnavailable

        try:
            dial = set_skip_rate(run_, args.skip_rate)
        except SkipRateUnavailable as e:
            raise UserError(f"--skip-rate: {e}") from None
    completion = generate_text(run_, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                               args.seed)
    print(args.prompt + completion)
    report = mod_report(run_, dial)
    if report is not None:
        import sys

        print(f"[nagmoe] {report}", file=sys.stderr)
    return 0
