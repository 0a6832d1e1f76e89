"""`nagmoe train --config PATH [--run-dir DIR] [key.sub=value ...]`: train, resuming from the latest valid
checkpoint in the run dir; only the schedule-length keys and the layout (parallel.ep, train.micro_batch_tokens,
the world size) may differ on resume unless --accept-config-change (nagmoe/rundir/permissions.py: --take-over,
--start-over; plain --force is refused).

Distributed: under torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or one srun task per rank (SLURM_*), e.g.
`torchrun --standalone --nproc_per_node=2 -m nagmoe train --config configs/tiny.yaml parallel.ep=2`.
`parallel.*` is checked against the world size before any process group is created (exit 2)."""
import os

from nagmoe.commands.common import add_config_arguments, config_from_args, launched_process_group
from nagmoe.base.environment import check_start_settings
from nagmoe.rundir.permissions import add_train_permissions, check_config_sha256, refuse_force


def add_arguments(p):
    add_config_arguments(p)
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<config name>)")
    add_train_permissions(p)
    p.add_argument("--quiet", action="store_true", help="no start-up lines and no progress (unless --progress)")
    p.add_argument("--progress", choices=("auto", "lines", "off"), default=None,
                   help="auto: a bar on a terminal, plain lines otherwise (the default, 'off' under --quiet); "
                        "lines: plain '[nagmoe] step ...' lines (job scripts); off: none")


def run(args) -> int:
    from nagmoe.data.corpus import check_data_preparable
    from nagmoe.parallel.mesh import ParallelMesh
    from nagmoe.train.trainer import Trainer

    refuse_force(args, train=True)
    check_start_settings(announce=True)  # NAGMOE_* settings and job variables: one line, before any write
    check_config_sha256(args.config, args.config_sha256)  # a job's acceptance holds for its submitted config only
    cfg = config_from_args(args)
    check_data_preparable(cfg, args.config)  # unprepared data that cannot be prepared here: one line, exit 2
    run_dir = args.run_dir or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
    with launched_process_group(cfg) as (env, device):
        mesh = ParallelMesh.build(cfg, env.rank, env.world_size, env.local_rank, device.type)
        trainer = Trainer(cfg, run_dir, accept_config_change=args.accept_config_change, take_over=args.take_over,
                          start_over=args.start_over, quiet=args.quiet, mesh=mesh)
        trainer.progress_mode = args.progress
        trainer.run()
    return 0
