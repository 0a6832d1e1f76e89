"""`nagmoe preflight --dir DIR [--steps N] [--gpu-memory GB]`: one rank's part of a preflight job (written and
submitted by `nagmoe launch slurm --preflight`; run under torchrun like `nagmoe train`): a bandwidth probe, N
training steps of DIR/slurm/config.yaml in DIR/run, a save and a resume, peak memory against the estimate; a
MoD config skips from its first step and is timed beside the same model at full depth (DIR/run-full-depth).
Rank 0 writes DIR/summary.json and prints the verdict (nagmoe/train/preflight.py); exit 1 when a check fails."""
import os

from nagmoe.rundir.names import CONFIG_FILE, SLURM_DIR, SUMMARY_FILE


def add_arguments(p):
    p.add_argument("--dir", required=True, help="the preflight directory (slurm/config.yaml inside)")
    p.add_argument("--steps", type=int, default=3, help="training steps before the save (default 3)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="CPU mode: the GPU memory per rank to check the layout's CUDA estimate against")


def run(args) -> int:
    from nagmoe.commands.common import launched_process_group
    from nagmoe.config import load_config
    from nagmoe.base.errors import UserError
    from nagmoe.train.preflight import format_verdict, run_preflight

    if args.steps < 1:
        raise UserError(f"--steps: {args.steps} must be >= 1")
    config = os.path.join(args.dir, SLURM_DIR, CONFIG_FILE)
    if not os.path.isfile(config):
        raise UserError(f"{config}: no preflight config (write one with `nagmoe launch slurm --preflight`)")
    with launched_process_group(load_config(config)):
        summary = run_preflight(args.dir, args.steps, args.gpu_memory)
    if summary is None:
        return 0
    print(format_verdict(summary), flush=True)
    print(f"summary: {os.path.join(os.path.abspath(args.dir), SUMMARY_FILE)}")
    return 0 if summary["verdict"] == "PASS" else 1
