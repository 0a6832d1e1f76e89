"""`nagmoe report RUN_DIR [RUN_DIR ...] --out DIR [--title T] [--eval-items N] [--analysis-tokens N]`: compare
runs in one self-contained HTML page, DIR/report.html (figures embedded; also as files under DIR/figures/, the
numbers in DIR/report.json). What it contains: nagmoe/analysis/report.py and docs/report.md.

Run dirs named RUN-sSEED group by RUN (mean ± sd over seeds). A run dir that cannot be used is named in the
report's "Problems" section and on stderr; the others still render. Exit status 2 when no run dir is usable.
"""
from __future__ import annotations

import sys

from nagmoe.base.errors import UserError


def add_arguments(p):
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="training run dirs (config.yaml, metrics.jsonl, ...)")
    p.add_argument("--out", required=True, metavar="DIR", help="where report.html, figures/ and report.json go")
    p.add_argument("--title", default=None, help="page title (default 'nagmoe report')")
    p.add_argument("--description", default="", help="one line under the title")
    p.add_argument("--eval-items", type=int, default=200, metavar="N",
                   help="items of the offline Shakespeare next-line task per run (0 = no eval)")
    p.add_argument("--analysis-tokens", type=int, default=16384, metavar="N",
                   help="validation tokens of the depth analysis per run (0 = no analysis, no dial)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def run(args) -> int:
    from nagmoe.analysis.report import write_report

    for flag in ("eval_items", "analysis_tokens"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be >= 0 (0 = skip)")
    data = write_report(args.run_dirs, args.out, title=args.title, description=args.description,
                        eval_items=args.eval_items, analysis_tokens=args.analysis_tokens, device=args.device,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    for problem in data["problems"]:
        print(f"nagmoe report: {problem}", file=sys.stderr)
    if not data["runs"]:
        raise UserError(f"no usable run dir among {len(args.run_dirs)} given (see {data['html']})")
    print(data["html"])
    return 0
