"""Slurm launch: render the sbatch templates in `launch/`, write them with the resolved config into the run
dir, submit with `sbatch`.

Training (`launch/train.sbatch`): N nodes, one task per node, `srun torchrun --nnodes $SLURM_NNODES
--nproc_per_node G --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT -m nagmoe train ...`.
GPU mode asks for G GPUs per node (one rank each); CPU mode (`gpus_per_node=0`) runs K ranks per node on
gloo with the same template. Files, all on the shared file system:

    RUN_DIR/slurm/config.yaml     the resolved config (overrides applied), what every restart trains
    RUN_DIR/slurm/train.sbatch    the rendered script (resubmit it by hand with `sbatch` if ever needed)
    RUN_DIR/slurm/slurm-<job>.out the job's log (appended across requeues)

Data preparation (`launch/prepare_data.sbatch`, three jobs): the tokenizer, then the corpus slices as a job
array (afterok), then the merge (afterok on the whole array); `--kill-on-invalid-dep` cancels what can no
longer run when a step fails.

Scripts take data, never code (issue 40): in the script body every path is `shlex.quote`d (never inside double
quotes); in `#SBATCH` lines, which bash skips but sbatch parses itself (quotes group, `\\` escapes, `#` starts a
comment, a line ends at a newline) and Slurm expands (`%j` in `--output`), partition, account, time and job name
are one word of a safe alphabet, a path is double-quoted when it needs it with `%` doubled in `--output`, a
control character or a backslash in a path is refused, and `--sbatch-arg` values may not hold a control character
(docs/decisions.md, "Issue 40: job scripts").
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

import nagmoe
from nagmoe.base.errors import UserError
from nagmoe.base.files import write_atomic
from nagmoe.rundir.names import CHECKPOINTS, CONFIG_FILE, MARKER_FILE, PREFLIGHT_DIR, REQUEST_FILE, SLURM_DIR

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(nagmoe.__file__))), "launch")
TRAIN_TEMPLATE = "train.sbatch"
PREPARE_TEMPLATE = "prepare_data.sbatch"
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")
# One #SBATCH value needing no quoting: partition, account, time, job name. Wider values (paths) are quoted.
_WORD = re.compile(r"[A-Za-z0-9_.+,:=@-]+")
_NOT_WORD = re.compile(r"[^A-Za-z0-9_.+,:=@-]")
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_./%+,:=@~-]+")
# C0, DEL, C1 and the Unicode line breaks: a newline ends a #SBATCH line and starts a shell line; CR and tab
# split sbatch's words
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
POLL_ENV = "NAGMOE_REQUEUE_POLL_S"  # read by launch/train.sbatch's requeue block, with the same check
_SECONDS = re.compile(r"[0-9]{1,6}")


@dataclass
class SlurmOptions:
    """What the user chose on the command line (None = the cluster's default / derived)."""
    nodes: int = 1
    gpus_per_node: int = 8
    procs_per_node: Optional[int] = None  # default: gpus_per_node, or 1 in CPU mode
    cpus_per_task: Optional[int] = None  # CPU mode default: procs_per_node
    partition: Optional[str] = None
    time: Optional[str] = None
    account: Optional[str] = None
    job_name: Optional[str] = None
    signal_seconds: int = 120  # USR1 to the batch shell this long before the time limit
    max_restarts: int = 3  # a failed training step requeues the job at most this often (train.sbatch)
    sbatch_args: list = field(default_factory=list)  # extra `#SBATCH` options, verbatim

    @property
    def cpu_mode(self) -> bool:
        return self.gpus_per_node == 0

    def validate(self) -> "SlurmOptions":
        if self.nodes < 1:
            raise UserError(f"--nodes: {self.nodes} must be >= 1")
        if self.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node: {self.gpus_per_node} must be >= 0 (0 = CPU mode)")
        if self.procs_per_node is None:
            self.procs_per_node = self.gpus_per_node or 1
        if self.procs_per_node < 1:
            raise UserError(f"--procs-per-node: {self.procs_per_node} must be >= 1")
        if not self.cpu_mode and self.procs_per_node != self.gpus_per_node:
            raise UserError(f"--procs-per-node: {self.procs_per_node} differs from --gpus-per-node "
                            f"{self.gpus_per_node}; GPU mode runs one rank per GPU (use --gpus-per-node 0 "
                            "for CPU ranks)")
        if self.cpus_per_task is None and self.cpu_mode:
            self.cpus_per_task = self.procs_per_node
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise UserError(f"--cpus-per-task: {self.cpus_per_task} must be >= 1")
        if self.signal_seconds < 1:
            raise UserError(f"--signal-seconds: {self.signal_seconds} must be >= 1")
        if not 0 <= self.max_restarts <= 1000:
            raise UserError(f"--max-restarts: {self.max_restarts} must be in [0, 1000]")
        for name in ("partition", "time", "account", "job_name"):
            value = getattr(self, name)
            if value is not None:
                sbatch_word(value, f"--{name.replace('_', '-')}")
        for arg in self.sbatch_args:
            bad = _CONTROL.search(arg)
            if bad:
                raise UserError(f"--sbatch-arg: {shown(arg)} contains a control character ({bad.group()!r}); "
                                "each value is one #SBATCH line")
            if not arg.startswith("-"):
                raise UserError(f"--sbatch-arg: {shown(arg)} is not an sbatch option (e.g. --exclusive)")
        return self


# ----------------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------------
def read_template(name: str) -> str:
    path = os.path.join(TEMPLATE_DIR, name)
    if not os.path.isfile(path):
        raise UserError(f"{path}: sbatch template not found (nagmoe must run from its source tree: "
                        "pip install -e .)")
    with open(path) as f:
        return f.read()


def fill(template: str, values: dict) -> str:
    """Replace every `{{NAME}}`; a placeholder without a value is a bug in the caller, not user input."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise KeyError(f"template placeholders without a value: {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def shown(value: str) -> str:
    """A user's value in a message: repr, at most 60 characters of it."""
    return repr(value[:60]) + ("..." if len(value) > 60 else "")


def sbatch_word(value: str, what: str) -> str:
    if not _WORD.fullmatch(value):
        raise UserError(f"{what}: {shown(value)} must be one word of letters, digits and . _ + , : = @ - "
                        "(it goes into a #SBATCH line)")
    return value


def job_name_from(text: str) -> str:
    """A default job name made of a path's name: the characters outside the #SBATCH word alphabet become `_`."""
    return _NOT_WORD.sub("_", text)


def check_sbatch_path(path: str, what: str) -> str:
    """`path` if a #SBATCH line can carry it (`sbatch_path_value`); UserError naming `what` otherwise."""
    bad = _CONTROL.search(path)
    if bad:
        raise UserError(f"{what}: {shown(path)} contains a control character ({bad.group()!r}); a #SBATCH line "
                        "cannot carry it (a newline would start a shell line)")
    if "\\" in path:  # sbatch's escape character, and Slurm drops every `%` pattern of a log name holding one
        raise UserError(f"{what}: {shown(path)} contains a backslash, which sbatch and Slurm's log-name patterns "
                        "read as an escape; use a path without one")
    return path


def sbatch_path_value(value: str) -> str:
    """A checked path as the value of a #SBATCH option: as it is when plain, else double-quoted with `\\"` for a
    quote (sbatch groups a quoted word and takes spaces, `'`, `#`, `$(...)` literally inside it)."""
    return value if _PLAIN_PATH.fullmatch(value) else '"' + value.replace('"', '\\"') + '"'


def requeue_poll_problem(env=None) -> Optional[str]:
    """The warning for an invalid NAGMOE_REQUEUE_POLL_S in this environment (sbatch's default --export=ALL
    carries it into the job, whose requeue block then uses 60 s), or None."""
    value = (os.environ if env is None else env).get(POLL_ENV)
    if not value or _SECONDS.fullmatch(value):
        return None
    return (f"[nagmoe] WARNING: {POLL_ENV}={shown(value)} is not a whole number of seconds (0-999999); a "
            "preempted job will wait the default 60 s for summary.json before requeueing")


def warn_job_environment() -> None:
    """Before rendering: say now what a preempted job would otherwise only say in its log."""
    problem = requeue_poll_problem()
    if problem:
        print(problem, file=sys.stderr)


def sbatch_lines(opts: SlurmOptions, job_name: str, log_dir: str, log_name: str, *, log_dir_what: str,
                 nodes: int = 1, gpus: int = 0, cpus_per_task: Optional[int] = None, array: Optional[str] = None,
                 preemptible: bool = False, extra: tuple = ()) -> str:
    """The #SBATCH block. The log goes to LOG_DIR/LOG_NAME (LOG_NAME: our own `%` pattern, e.g. slurm-%j.out);
    LOG_DIR (from `log_dir_what`) and the working directory are checked and quoted here, for every job."""
    log_dir = check_sbatch_path(log_dir, log_dir_what)
    # Slurm expands `%` patterns in --output: the folder's own `%` doubled (literal), LOG_NAME's kept (the job id).
    # --chdir is no pattern field: its `%` stays single.
    output = sbatch_path_value(os.path.join(log_dir.replace("%", "%%"), log_name))
    chdir = sbatch_path_value(check_sbatch_path(os.getcwd(), "working directory"))
    lines = [f"--job-name={sbatch_word(job_name, 'job name')}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if gpus:
        lines.append(f"--gpus-per-node={gpus}")
    if cpus_per_task:
        lines.append(f"--cpus-per-task={cpus_per_task}")
    for name in ("partition", "time", "account"):
        if getattr(opts, name):
            lines.append(f"--{name}={getattr(opts, name)}")
    if array:
        lines.append(f"--array={array}")
    lines += [f"--output={output}", "--open-mode=append", f"--chdir={chdir}"]
    if preemptible:
        lines += ["--requeue", f"--signal=B:USR1@{opts.signal_seconds}"]
    lines += list(extra) + list(opts.sbatch_args)
    return "\n".join(f"#SBATCH {line}" for line in lines)


def torchrun_path() -> str:
    """The torchrun next to this Python (the venv's), so the job runs the same installation."""
    here = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return here if os.path.isfile(here) else (shutil.which("torchrun") or "torchrun")


def render_train_script(opts: SlurmOptions, run_dir: str, config_sha256: Optional[str] = None,
                        accept_config_change: bool = False, run_dir_what: str = "--run-dir") -> str:
    """`run_dir_what`: the option the run dir came from, for messages (an experiment's: --runs-root).
    `config_sha256`: the submitted config's; the script trains the pinned RUN_DIR/slurm/config-<sha12>.yaml
    and `nagmoe train` checks the hash (nagmoe.launch.pinned_config). Never --take-over or --start-over."""
    from nagmoe.launch.pinned_config import pinned_name
    from nagmoe.rundir.permissions import script_train_args

    opts.validate()
    run_dir = os.path.abspath(run_dir)
    job_name = opts.job_name or job_name_from(f"nagmoe-{os.path.basename(run_dir)}")
    threads = max(1, (opts.cpus_per_task or opts.procs_per_node) // opts.procs_per_node)
    # GPU nodes whole unless the CPUs are given: the cluster default (often 1 CPU per task) would pin all of
    # a node's ranks and their data loading to one core
    whole_node = ("--exclusive",) if not opts.cpu_mode and opts.cpus_per_task is None else ()
    mode = (f"# CPU mode: {opts.procs_per_node} gloo rank(s) per node on CPUs (train.device=cpu)" if opts.cpu_mode
            else f"# GPU mode: one NCCL rank per GPU, {opts.gpus_per_node} per node")
    return fill(read_template(TRAIN_TEMPLATE), {
        "SBATCH_LINES": sbatch_lines(opts, job_name, os.path.join(run_dir, SLURM_DIR), "slurm-%j.out",
                                     log_dir_what=run_dir_what, nodes=opts.nodes, gpus=opts.gpus_per_node,
                                     cpus_per_task=opts.cpus_per_task, preemptible=True, extra=whole_node),
        "RUN_DIR": shlex.quote(run_dir), "TORCHRUN": shlex.quote(torchrun_path()),
        "PROCS_PER_NODE": opts.procs_per_node, "THREADS_PER_PROC": threads,
        "REQUEST_FILE": REQUEST_FILE, "MARKER_FILE": MARKER_FILE, "MAX_RESTARTS": int(opts.max_restarts),
        "MODE_LINE": mode, "TRAIN_ARGS": script_train_args(config_sha256, accept_config_change),
        "CONFIG_NAME": pinned_name(config_sha256) if config_sha256 else "config.yaml",
    })


PREFLIGHT_TEMPLATE = "preflight.sbatch"


def render_preflight_script(opts: SlurmOptions, run_dir: str, steps: int = 3,
                            gpu_memory_gb: Optional[float] = None) -> str:
    """The preflight job of this layout (nagmoe/train/preflight.py): in RUN_DIR/preflight, never touching the
    run's own checkpoints."""
    opts.validate()
    directory = os.path.join(os.path.abspath(run_dir), PREFLIGHT_DIR)
    threads = max(1, (opts.cpus_per_task or opts.procs_per_node) // opts.procs_per_node)
    whole_node = ("--exclusive",) if not opts.cpu_mode and opts.cpus_per_task is None else ()
    mode = (f"# CPU mode: {opts.procs_per_node} gloo rank(s) per node on CPUs (train.device=cpu)" if opts.cpu_mode
            else f"# GPU mode: one NCCL rank per GPU, {opts.gpus_per_node} per node")
    job_name = f"{opts.job_name or job_name_from('nagmoe-' + os.path.basename(os.path.abspath(run_dir)))}-preflight"
    return fill(read_template(PREFLIGHT_TEMPLATE), {
        "SBATCH_LINES": sbatch_lines(opts, job_name, os.path.join(directory, SLURM_DIR), "slurm-%j.out",
                                     log_dir_what="--run-dir", nodes=opts.nodes, gpus=opts.gpus_per_node,
                                     cpus_per_task=opts.cpus_per_task, extra=whole_node),
        "DIR": shlex.quote(directory), "TORCHRUN": shlex.quote(torchrun_path()),
        "PROCS_PER_NODE": opts.procs_per_node, "THREADS_PER_PROC": threads, "MODE_LINE": mode, "STEPS": steps,
        "GPU_MEMORY": f" --gpu-memory {gpu_memory_gb:g}" if gpu_memory_gb and opts.cpu_mode else "",
    })


def render_prepare_scripts(opts: SlurmOptions, launch_dir: str, num_slices: int,
                           with_tokenizer: bool = True) -> dict:
    """{step: script text} for the data-preparation jobs (tokenizer only `with_tokenizer`)."""
    opts.validate()
    launch_dir = os.path.abspath(launch_dir)
    config = shlex.quote(os.path.join(launch_dir, SLURM_DIR, CONFIG_FILE))
    base = opts.job_name or job_name_from(f"nagmoe-prep-{os.path.basename(launch_dir)}")
    logs = os.path.join(launch_dir, SLURM_DIR)
    steps = {
        "tokenizer": ("--tokenizer-only", None, "slurm-%j.out"),
        "slices": (f"--num-shards {num_slices}", f"0-{num_slices - 1}", "slurm-%A_%a.out"),
        "merge": (f"--merge --num-shards {num_slices}", None, "slurm-%j.out"),
    }
    template = read_template(PREPARE_TEMPLATE)
    out = {}
    for step, (args, array, log) in steps.items():
        if step == "tokenizer" and not with_tokenizer:
            continue
        out[step] = fill(template, {
            "SBATCH_LINES": sbatch_lines(opts, f"{base}-{step}", logs, log, log_dir_what="--run-dir",
                                         cpus_per_task=opts.cpus_per_task, array=array,
                                         extra=("--kill-on-invalid-dep=yes",)),
            "STEP": step, "PYTHON": shlex.quote(sys.executable), "CONFIG": config, "PREPARE_ARGS": args,
        })
    return out


# ----------------------------------------------------------------------------------------------------------
# Files and submission
# ----------------------------------------------------------------------------------------------------------
def check_resume_config(run_dir: str, config_yaml: str, accept_config_change: bool) -> None:
    """Refuse at submission what the trainer would refuse at start: resuming a run dir that has checkpoints
    with a config that differs beyond the schedule-length and layout keys."""
    from nagmoe.config import config_from_dict, yaml_load
    from nagmoe.rundir.info import read_saved_config, resume_differences

    ckpts = os.path.join(run_dir, CHECKPOINTS)
    if accept_config_change or not (os.path.isdir(ckpts) and os.listdir(ckpts)):
        return
    saved = read_saved_config(run_dir)
    if saved is None:
        return
    diffs = resume_differences(run_dir, config_from_dict(yaml_load(config_yaml) or {}, validate=False))
    if diffs:
        raise UserError(f"{run_dir}: has checkpoints of a different config ({'; '.join(diffs[:3])}"
                        f"{' ...' if len(diffs) > 3 else ''}); use another --run-dir or pass --accept-config-change")


def write_script(path: str, text: str) -> None:
    """A job script through the safe writer (nagmoe/base/files.py). Created 0o777 minus the umask (0755, or 0750
    under umask 027): executable from its creation, so no chmod of a path that a planted link could redirect
    (sbatch itself needs no execute bit)."""
    write_atomic(path, text, durable=True, mode=0o777)


def write_files(directory: str, config_yaml: str, scripts: dict) -> dict:
    """Write DIR/slurm/config.yaml (the latest submission, for people), the pinned DIR/slurm/config-<sha12>.yaml
    (what the job trains) and DIR/slurm/<name> for each script; returns {name: path}."""
    from nagmoe.launch.pinned_config import write_pinned

    folder = os.path.join(os.path.abspath(directory), SLURM_DIR)
    os.makedirs(folder, exist_ok=True)
    paths = {"config.yaml": os.path.join(folder, "config.yaml")}
    paths["pinned"] = write_pinned(directory, config_yaml)  # content-named: a later launch cannot change it
    write_atomic(paths["config.yaml"], config_yaml, durable=True)
    for name, text in scripts.items():
        paths[name] = os.path.join(folder, name)
        write_script(paths[name], text)
    return paths


def require_sbatch() -> str:
    path = shutil.which("sbatch")
    if path is None:
        raise UserError("sbatch: not found on PATH (submit from a Slurm login node, or use --dry-run)")
    return path


def submit(script: str, dependency: Optional[str] = None) -> str:
    """`sbatch --parsable [--dependency=...] SCRIPT` -> the job id."""
    cmd = [require_sbatch(), "--parsable"] + ([f"--dependency={dependency}"] if dependency else []) + [script]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise UserError(f"sbatch {os.path.basename(script)}: {first}")
    return out.stdout.strip().split(";")[0]  # "<id>[;cluster]"
