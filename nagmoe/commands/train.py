"""`nagmoe train --config PATH [--run-dir DIR] [key.sub=value ...]`: train, resuming from the latest valid
checkpoint in the run dir; only the schedule-length keys may differ on resume unless --force."""
import os

from nagmoe.commands.common import add_config_arguments, config_from_args


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<config name>)")
    p.add_argument("--force", action="store_true", help="resume even if the config differs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    from nagmoe.train.trainer import Trainer

    cfg = config_from_args(args)
    run_dir = args.run_dir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
    Trainer(cfg, run_dir, force=args.force, quiet=args.quiet).run()
    return 0
