"""`nagmoe experiment FILE [--only RUN ...] [--runs-root DIR] [--dry-run] [--report-only | --no-report]
[--slurm [--dry-run] SLURM OPTIONS] [key=value ...]`: a FLOP-matched experiment (format: nagmoe/launch/experiment.py).

Locally every run x seed trains one after another into RUNS_ROOT/NAME/RUN-sSEED/ (finished runs are skipped,
unfinished ones resume), then the report is written to RUNS_ROOT/NAME/report.html. `--slurm` submits one
training job per unfinished run x seed and a report job with `--dependency=afterany:<all of them>`;
`--dry-run` only lists what would run (jobs, dependency, the shared budget). Overrides on the command line
apply to every run. Exit status 1 when a local run failed (the report still shows the others).
"""
from __future__ import annotations

from nagmoe.base.errors import UserError
from nagmoe.base.environment import check_start_settings
from nagmoe.rundir.permissions import add_accept_config_change, refuse_force


def add_arguments(p):
    p.add_argument("file", metavar="FILE", help="experiment YAML (configs/experiments/NAME.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides for every run")
    p.add_argument("--only", action="append", default=[], metavar="RUN", help="only this run (repeatable)")
    p.add_argument("--runs-root", default="runs", metavar="DIR", help="run dirs go to DIR/NAME/RUN-sSEED")
    p.add_argument("--dry-run", action="store_true", help="list the runs (or jobs) and the budget; run nothing")
    p.add_argument("--report-only", action="store_true", help="train nothing; write the report of what exists")
    p.add_argument("--no-report", action="store_true", help="train only")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="device of the report")
    s = p.add_argument_group("Slurm (with --slurm; as `nagmoe launch slurm`)")
    s.add_argument("--slurm", action="store_true", help="submit the runs as Slurm jobs plus an afterany report job")
    s.add_argument("--nodes", type=int, default=1, help="nodes per training job")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, one rank each (0 = CPU mode)")
    s.add_argument("--procs-per-node", type=int, default=None, help="ranks per node (CPU mode; default 1)")
    s.add_argument("--cpus-per-task", type=int, default=None, help="CPUs of a node's task")
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default=None, help="time limit per training job (jobs requeue themselves)")
    s.add_argument("--account", default=None)
    s.add_argument("--job-name", default=None, help="job name prefix (default: the experiment's name)")
    s.add_argument("--signal-seconds", type=int, default=120, help="USR1 this long before the time limit")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION", help="extra #SBATCH option")
    add_accept_config_change(s)  # rendered with each config's sha256 (nagmoe/rundir/permissions.py)
    s.add_argument("--despite-live-job", action="store_true",
                   help="submit another config although a job of that run dir is still pending or running")


def _slurm_options(args):
    from nagmoe.launch.slurm import SlurmOptions

    return SlurmOptions(nodes=args.nodes, gpus_per_node=args.gpus_per_node, procs_per_node=args.procs_per_node,
                        cpus_per_task=args.cpus_per_task, partition=args.partition, time=args.time,
                        account=args.account, job_name=args.job_name, signal_seconds=args.signal_seconds,
                        sbatch_args=list(args.sbatch_arg)).validate()


def run(args) -> int:
    from nagmoe.launch import experiment as ex

    refuse_force(args)
    check_start_settings(announce=True)  # NAGMOE_* settings and job variables: one line, before any write
    if args.report_only and args.no_report:
        raise UserError("--report-only and --no-report exclude each other")
    exp = ex.load_experiment(args.file)
    plans = exp.plan(args.runs_root, args.only, tuple(args.overrides or ()))

    if args.slurm:
        from nagmoe.launch.slurm import require_sbatch, warn_job_environment

        opts = _slurm_options(args)
        if not args.dry_run:
            require_sbatch()  # before anything is written
        warn_job_environment()  # now, not only in the log of a preempted job
        jobs, report = ex.slurm_jobs(exp, plans, opts, args.runs_root, args.accept_config_change)
        print(ex.describe_slurm(exp, plans, jobs, report, opts), flush=True)
        if args.dry_run:
            return 0
        ex.submit_slurm(jobs, report, despite_live_job=args.despite_live_job)
        return 0

    print(ex.describe(exp, plans), flush=True)
    if args.dry_run:
        return 0
    failed = []
    if not args.report_only:
        ex.check_data(plans)
        status = ex.train_local(plans, quiet=args.quiet)
        failed = [label for label, s in status.items() if s.startswith("failed")]
    if not args.no_report:
        ex.write_experiment_report(exp, args.runs_root, args.device)
    if failed:
        print(f"[experiment] failed: {', '.join(failed)} (see above); the report shows the others")
        return 1
    return 0
