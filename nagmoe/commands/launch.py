"""`nagmoe launch slurm --config PATH [--nodes N] [--gpus-per-node 8 | --gpus-per-node 0 --procs-per-node K]
[--partition P] [--time T] [--account A] [--job-name J] [--run-dir D] [--dry-run | --submit] [key=value ...]`

Renders `launch/train.sbatch` for N nodes (one task per node; torchrun starts the node's ranks) and writes it,
with the resolved config, to RUN_DIR/slurm/; `--submit` also runs sbatch and prints the job id and run dir;
`--dry-run` only prints the script. The job requeues itself after a preemption checkpoint (USR1 to the batch
shell `--signal-seconds` before the time limit). `--array N` instead prepares the data: a tokenizer job, N
corpus slices as a job array, a merge job, chained with afterok.
"""
from __future__ import annotations

import os
import sys

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.base.errors import UserError
from nagmoe.rundir.names import PREFLIGHT_DIR, SLURM_DIR, SUMMARY_FILE
from nagmoe.base.environment import check_start_settings
from nagmoe.rundir.permissions import add_accept_config_change, refuse_force


def add_arguments(p):
    sub = p.add_subparsers(dest="launcher", metavar="LAUNCHER", required=True)
    s = sub.add_parser("slurm", help="render / submit sbatch scripts (training, or data prep with --array)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    add_config_arguments(s)
    s.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    s.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, one rank each (0 = CPU mode)")
    s.add_argument("--procs-per-node", type=int, default=None,
                   help="ranks per node (default: the GPUs; CPU mode: 1)")
    s.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPUs of the node's task (default: the cluster's; CPU mode: one per rank)")
    s.add_argument("--partition", default=None)
    s.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00 (the job requeues itself)")
    s.add_argument("--account", default=None)
    s.add_argument("--job-name", default=None, help="default nagmoe-<run dir name>")
    s.add_argument("--run-dir", default=None,
                   help="on the shared file system (default runs/<config name>; --array: runs/prepare-<name>)")
    s.add_argument("--signal-seconds", type=int, default=120,
                   help="USR1 to the batch shell this long before the time limit: checkpoint and requeue")
    s.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="a failed training step (a crash, a host lost, a hang) requeues the job from its last "
                        "checkpoint at most N times, never without a new checkpoint since the last restart")
    s.add_argument("--sbatch-arg", action="append", default=[], metavar="OPTION",
                   help="extra #SBATCH option, verbatim (repeatable), e.g. --sbatch-arg=--exclusive")
    add_accept_config_change(s)  # rendered into the script with the config's sha256 (nagmoe/rundir/permissions.py)
    s.add_argument("--despite-live-job", action="store_true",
                   help="submit another config although a job of this run dir is still pending or running")
    s.add_argument("--gpu-memory", type=float, default=80.0, metavar="GB",
                   help="memory of one GPU; --dry-run warns when the layout's estimate exceeds it (default 80)")
    s.add_argument("--array", type=int, default=None, metavar="N",
                   help="data preparation instead of training: N corpus slices as a job array + merge")
    mode = s.add_mutually_exclusive_group()
    s.add_argument("--preflight", action="store_true",
                   help="a short job at this layout instead of the run: bandwidth, steps, save/resume, memory "
                        "vs the estimate (in RUN_DIR/preflight; CPU mode checks the estimate against --gpu-memory)")
    s.add_argument("--preflight-steps", type=int, default=3, metavar="N")
    mode.add_argument("--dry-run", action="store_true", help="print the script(s); write and submit nothing")
    mode.add_argument("--submit", action="store_true", help="write and submit with sbatch")


def _options(args):
    from nagmoe.launch.slurm import SlurmOptions

    return SlurmOptions(nodes=1 if args.nodes is None else args.nodes, gpus_per_node=args.gpus_per_node,
                        procs_per_node=args.procs_per_node, cpus_per_task=args.cpus_per_task,
                        partition=args.partition, time=args.time, account=args.account, job_name=args.job_name,
                        signal_seconds=args.signal_seconds, max_restarts=args.max_restarts,
                        sbatch_args=list(args.sbatch_arg)).validate()


def _config_stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def run(args) -> int:
    from nagmoe.launch import slurm

    refuse_force(args)
    check_start_settings(announce=True)  # NAGMOE_* settings and job variables: one line, before any write
    opts = _options(args)
    if args.submit:
        slurm.require_sbatch()  # before anything is written
    cfg = config_from_args(args)
    if args.array is not None:
        return _run_prepare(args, opts, cfg)

    from nagmoe.config import dump_yaml, set_key

    if opts.cpu_mode:
        if cfg.train.device == "cuda":
            raise UserError("train.device=cuda with --gpus-per-node 0 (CPU mode): drop one of them")
        set_key(cfg, "train.device", "cpu")  # gloo ranks on CPUs even on a node that has GPUs
    elif cfg.train.device == "cpu":
        raise UserError(f"train.device=cpu with --gpus-per-node {opts.gpus_per_node}: use --gpus-per-node 0 "
                        "--procs-per-node K for CPU ranks")
    run_dir = os.path.abspath(args.run_dir or os.path.join("runs", _config_stem(args.config)))
    config_yaml = dump_yaml(cfg)
    if args.preflight:
        return _run_preflight(args, opts, cfg, run_dir, config_yaml)
    from nagmoe.launch import pinned_config

    sha = pinned_config.config_sha256(config_yaml)
    slurm.check_resume_config(run_dir, config_yaml, args.accept_config_change)
    slurm.warn_job_environment()  # now, not only in the log of a preempted job
    script = slurm.render_train_script(opts, run_dir, config_sha256=sha,
                                       accept_config_change=args.accept_config_change)
    if args.dry_run:
        if not opts.cpu_mode:
            _warn_memory(cfg, opts, args.gpu_memory)
        sys.stdout.write(script)
        return 0
    if args.submit:  # before anything is written: a queued job of another config keeps its run dir
        pinned_config.check_relaunch(run_dir, sha, args.despite_live_job)
    paths = slurm.write_files(run_dir, config_yaml, {slurm.TRAIN_TEMPLATE: script})
    path = paths[slurm.TRAIN_TEMPLATE]
    if not args.submit:
        print(f"wrote {path} (config {paths['pinned']}); submit with: sbatch {path}")
        return 0
    job = slurm.submit(path)
    pinned_config.record_job(run_dir, job, sha)
    log = os.path.join(run_dir, SLURM_DIR, f"slurm-{job}.out")
    print(f"submitted job {job}: {opts.nodes} node(s) x {opts.procs_per_node} rank(s); run dir {run_dir}; "
          f"log {log}")
    return 0


def _run_preflight(args, opts, cfg, run_dir: str, config_yaml: str) -> int:
    from nagmoe.launch import slurm

    if args.preflight_steps < 1:
        raise UserError(f"--preflight-steps: {args.preflight_steps} must be >= 1")
    script = slurm.render_preflight_script(opts, run_dir, args.preflight_steps, args.gpu_memory)
    if args.dry_run:
        if not opts.cpu_mode:
            _warn_memory(cfg, opts, args.gpu_memory)
        sys.stdout.write(script)
        return 0
    directory = os.path.join(run_dir, PREFLIGHT_DIR)
    path = slurm.write_files(directory, config_yaml, {slurm.PREFLIGHT_TEMPLATE: script})[slurm.PREFLIGHT_TEMPLATE]
    if not args.submit:
        print(f"wrote {path}; submit with: sbatch {path}")
        return 0
    job = slurm.submit(path)
    print(f"submitted preflight job {job}: {opts.nodes} node(s) x {opts.procs_per_node} rank(s); verdict in "
          f"{os.path.join(directory, SLURM_DIR, f'slurm-{job}.out')} and {os.path.join(directory, SUMMARY_FILE)}")
    return 0


def _warn_memory(cfg, opts, gpu_memory_gb: float) -> None:
    """The per-rank estimate of this layout (nagmoe/train/memory.py) on stderr, with a warning when it does
    not fit one GPU of `gpu_memory_gb` GB."""
    from nagmoe.train.memory import GIB, estimate_memory, micro_batch_rows

    if not gpu_memory_gb > 0:
        raise UserError(f"--gpu-memory: {gpu_memory_gb} must be > 0 (GB)")
    world = opts.nodes * opts.procs_per_node
    tokens = max(1, micro_batch_rows(cfg, world)) * cfg.data.seq_len  # the trainer's micro-batch
    est = estimate_memory(cfg, cfg.parallel.ep, tokens, "cuda", world)
    need = est["total"] / 1e9
    line = (f"[nagmoe] memory estimate per rank: {need:.1f} GB ({est['total'] / GIB:.1f} GiB: activations "
            f"{est['activations'] / 1e9:.1f} GB for {tokens:,} tokens per micro-step, worst-case expert receive "
            f"{est['receive_worst'] / 1e9:.1f} GB; `nagmoe params --memory` for every part)")
    print(line, file=sys.stderr)
    if need > gpu_memory_gb:
        print(f"[nagmoe] WARNING: the layout does not fit a {gpu_memory_gb:g} GB GPU: lower train.micro_batch_tokens "
              "(more accumulation steps), turn on train.activation_checkpointing, set model.moe.capacity_factor, "
              "or use more ranks", file=sys.stderr)


def _run_prepare(args, opts, cfg) -> int:
    from nagmoe.config import dump_yaml
    from nagmoe.data.corpus import resolve_corpus
    from nagmoe.launch import slurm

    n = args.array
    if n < 1:
        raise UserError(f"--array: {n} must be >= 1")
    if args.nodes not in (None, 1) or args.procs_per_node is not None:
        raise UserError("--array runs one process per slice: drop --nodes/--procs-per-node")
    corpus = resolve_corpus(cfg.data.corpus)
    if corpus.kind != "hub" and n > len(corpus.files):
        raise UserError(f"--array {n} exceeds the {len(corpus.files)} input files of data.corpus={corpus.name} "
                        "(slices are whole files)")
    launch_dir = os.path.abspath(args.run_dir or os.path.join("runs", f"prepare-{_config_stem(args.config)}"))
    scripts = slurm.render_prepare_scripts(opts, launch_dir, n, with_tokenizer=not cfg.data.tokenizer)
    names = {step: f"prepare_{step}.sbatch" for step in scripts}
    if args.dry_run:
        for step, text in scripts.items():
            print(f"# ===== {names[step]} =====")
            sys.stdout.write(text)
        return 0
    paths = slurm.write_files(launch_dir, dump_yaml(cfg), {names[s]: t for s, t in scripts.items()})
    if not args.submit:
        chain = " -> ".join(paths[names[s]] for s in scripts)
        print(f"wrote {chain}; submit in this order, each with --dependency=afterok:<previous job id>")
        return 0
    jobs, previous = {}, None
    for step in scripts:
        jobs[step] = previous = slurm.submit(paths[names[step]], f"afterok:{previous}" if previous else None)
    parts = [f"{step} job {job}" + (f" ({n} array tasks)" if step == "slices" else "") for step, job in jobs.items()]
    print(f"submitted {', '.join(parts)}: data dir {cfg.data.data_dir}; logs in "
          f"{os.path.join(launch_dir, SLURM_DIR)}")
    return 0
