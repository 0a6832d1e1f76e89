"""`nagmoe consolidate RUN_DIR [--checkpoint PATH] [--out FILE]`: one single-file checkpoint
(RUN_DIR/consolidated.pt: full model state incl. all experts + config) from the run's sharded DCP
checkpoint, loadable on one machine with `nagmoe.checkpoint.consolidate.load_consolidated(path)`."""


def add_arguments(p):
    p.add_argument("run_dir", help="run directory (with config.yaml and checkpoints/)")
    p.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the newest valid one)")
    p.add_argument("--out", default=None, help="output file (default: RUN_DIR/consolidated.pt)")


def run(args) -> int:
    from nagmoe.checkpoint.consolidate import consolidate_run

    print(consolidate_run(args.run_dir, checkpoint=args.checkpoint, out=args.out))
    return 0
