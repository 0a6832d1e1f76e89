"""The `nagmoe` command. Each subcommand lives in `nagmoe/commands/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches and turns user errors into
one line on stderr with exit code 2 (never a traceback)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from nagmoe.base.errors import UserError, one_line
from nagmoe.base.environment import inductor_cache_per_cpu_isa

# subcommand -> (module under nagmoe.commands, one-line help)
COMMANDS = {
    "config": ("config_cmd", "print the resolved config as YAML"),
    "params": ("params", "parameter counts (total, active, by part)"),
    "flops": ("flops", "training FLOPs per token and MoD token ratio"),
    "prepare-data": ("prepare_data", "tokenise a corpus into packed token shards"),
    "train": ("train", "train (resumes from the latest valid checkpoint in the run dir)"),
    "eval": ("eval", "CORE-style in-context scores (offline Shakespeare task, JSONL tasks, CORE bundle)"),
    "analyze": ("analyze", "depth, BOS-sink, confidence and MoD statistics of a run, as JSON"),
    "compare": ("compare", "paired difference of two runs in val bpb on the same windows, with its 95%% interval"),
    "experiment": ("experiment", "run a FLOP-matched experiment file"),
    "report": ("report", "compare run dirs in an HTML report"),
    "generate": ("generate", "sample from a trained run"),
    "launch": ("launch", "launch on a cluster (slurm)"),
    "preflight": ("preflight", "one rank's part of a preflight job (nagmoe launch slurm --preflight)"),
    "export-hf": ("export_hf", "the run's model as a self-contained Hugging Face model (remote code)"),
    "import-hf": ("import_hf", "a nagmoe Hugging Face export back into a run dir (eval, generate)"),
    "consolidate": ("consolidate", "one single-file checkpoint (RUN_DIR/consolidated.pt) from a sharded run"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _load(module_name: str):
    return importlib.import_module(f"nagmoe.commands.{module_name}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nagmoe", description="NAG residual-stream MoE pretraining")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        _load(module_name).add_arguments(p)
        p.set_defaults(_module=module_name)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may sit anywhere among the options (`--config c key=v --run-dir d key2=v`): argparse stops a
    # positional list at the first option, so collect the stragglers here.
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*(args.overrides or []), *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not args.command:
        parser.print_help()
        return 2
    inductor_cache_per_cpu_isa()  # a capped CPU capability compiles into a cache of its own (nagmoe.base.environment)
    module = _load(args._module)
    try:
        return int(module.run(args) or 0)
    except UserError as e:
        print(one_line(f"nagmoe {args.command}: error: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nagmoe {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nagmoe params | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
