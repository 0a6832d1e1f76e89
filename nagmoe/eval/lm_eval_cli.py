"""lm-evaluation-harness's own command line with nagmoe's model registered:

    python -m nagmoe.eval.lm_eval_cli run --model nagmoe --model_args run_dir=R[,add_bos_token=False] \
        --tasks T --include_path DIR --device cpu --output_path OUT

lm-eval 0.4.x finds a `--model` name only in its own registry (its table of built-in models; it reads no entry
points), so a bare `lm-eval run --model nagmoe` cannot see a model another package registers. This imports the
registration (nagmoe/eval/lm_eval_model.py), then runs lm-eval's command line unchanged: every subcommand and
option is lm-eval's, `--model hf` included. A bad nagmoe model argument ends in one line, exit 2.
"""
from __future__ import annotations

import sys

from nagmoe.base.errors import UserError, one_line


def main() -> int:
    import nagmoe.eval.lm_eval_model  # noqa: F401  (registers `nagmoe` next to lm-eval's own models)
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except UserError as e:
        print(one_line(f"lm-eval: error: {e}"), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
