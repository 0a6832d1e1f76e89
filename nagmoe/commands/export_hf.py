"""`nagmoe export-hf --run-dir R --out DIR [--checkpoint P] [--dtype float32|bfloat16] [--skip-rate r]
[--no-validate]`: the run's model as a self-contained Hugging Face model (nagmoe/hf/export.py); P may be a
weights-only milestone (RUN/milestones/step_N). A non-empty
--out is refused; the export is checked in a process without nagmoe before it is moved to --out (exit 1 and
nothing at --out when it does not reproduce the run)."""
from __future__ import annotations

import sys

from nagmoe.base.errors import UserError, one_line


def add_arguments(p):
    p.add_argument("--run-dir", required=True, help="a training run dir (config.yaml + checkpoints/)")
    p.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory for the export")
    p.add_argument("--checkpoint", default=None, metavar="P",
                   help="a checkpoint or milestone dir, e.g. RUN/milestones/step_N (default: the latest checkpoint)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="bfloat16 casts matrices, embedding and unembedding only (by role)")
    p.add_argument("--skip-rate", type=float, default=None, metavar="R",
                   help="MoD runs: export thresholds for this skip rate (the compute dial)")
    p.add_argument("--no-validate", action="store_true", help="skip the check in a process without nagmoe")


def run(args) -> int:
    if args.skip_rate is not None and not 0.0 <= args.skip_rate < 1.0:
        raise UserError(f"--skip-rate: {args.skip_rate} must be in [0, 1)")
    from nagmoe.hf.export import ExportCheckFailed, export_run
    from nagmoe.model.mod_calibration import SkipRateUnavailable

    try:
        result = export_run(args.run_dir, args.out, args.checkpoint, args.dtype, args.skip_rate,
                            validate=not args.no_validate)
    except SkipRateUnavailable as e:
        raise UserError(f"--skip-rate: {e}") from None
    except ExportCheckFailed as e:
        print(one_line(f"nagmoe export-hf: {e} (nothing written at --out)"), file=sys.stderr)
        return 1
    checked = result["checked"]
    how = (f"checked without nagmoe on {checked['rows']} validation rows ({checked['tokens']} tokens)" if checked
           else "not checked (--no-validate)")
    print(f"[nagmoe] exported to {result['out']}; {how}")
    return 0
