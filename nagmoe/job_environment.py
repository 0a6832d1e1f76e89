"""What a job learns from its environment (Slurm and torchrun variables), validated: a bad value is a
UserError naming the variable (exit 2) at start, before anything is written.

sbatch's default `--export=ALL` carries the submitting shell into the job, and a login shell may hold
variables of an earlier job or of a test: so a variable is believed only when the set it belongs to is
consistent (torchrun sets TORCHELASTIC_RUN_ID together with its rank variables), and test hooks act only under
NAGMOE_TEST_HOOKS=1."""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from nagmoe.errors import UserError, shown

RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"
TEST_HOOKS_ENV = "NAGMOE_TEST_HOOKS"  # "1": the NAGMOE_TEST_* hooks below take effect (tests only)
TEST_HOOK_PREFIX = "NAGMOE_TEST_"
# what torchrun (torch.distributed.run) sets in every worker besides TORCHELASTIC_RUN_ID
TORCHRUN_INTS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
# logged at start (describe_environment): what decides ports, threads, imports and the collectives; never
# anything else (keys, tokens and the rest of a login shell stay out of the logs)
LOGGED = ("MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
          "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_NNODES", "SLURM_PROCID", "SLURM_ARRAY_TASK_ID",
          "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
LOGGED_PREFIXES = ("NCCL_", "TORCH_", "NAGMOE_")

log = logging.getLogger("nagmoe.train")


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _count(name: str, raw: str) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise UserError(f"environment variable {name}={shown(raw, 40)} must be a count (0 to 999999999)")
    return int(raw)


def slurm_restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times Slurm has requeued this job (0 when unset or empty: a first start or no Slurm)."""
    raw = _env(environ).get(RESTART_COUNT_ENV) or ""
    return 0 if raw == "" else _count(RESTART_COUNT_ENV, raw)


def array_task_index(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN (the MIN defaults to 0), None when not an array task."""
    env = _env(environ)
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task is None or task == "":
        return None
    first = _count("SLURM_ARRAY_TASK_MIN", env.get("SLURM_ARRAY_TASK_MIN") or "0")
    index = _count("SLURM_ARRAY_TASK_ID", task) - first
    if index < 0:
        raise UserError(f"environment variables SLURM_ARRAY_TASK_ID={task} and SLURM_ARRAY_TASK_MIN={first}: "
                        "the task id is below the array's first id")
    return index


def launched_by_torchrun(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is a torchrun worker: TORCHELASTIC_RUN_ID together with torchrun's rank variables.
    TORCHELASTIC_RUN_ID alone (leaked from a parent shell) is refused: believing it would make a stand-alone
    `nagmoe train` exit 0 on preemption, which a batch script reads as 'finished'."""
    env = _env(environ)
    if not env.get("TORCHELASTIC_RUN_ID"):
        return False
    missing = [name for name in TORCHRUN_INTS if not env.get(name)]
    if missing:
        raise UserError(f"environment variable TORCHELASTIC_RUN_ID is set but {', '.join(missing)} not: this is "
                        "not a torchrun worker; unset TORCHELASTIC_RUN_ID (leaked from another job's shell?)")
    for name in TORCHRUN_INTS:
        _count(name, env[name])
    return True


def hook_setting(name: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """The value of test hook `name` (a NAGMOE_TEST_* variable), "" unless NAGMOE_TEST_HOOKS=1: a hook left
    in a login shell never changes what a production job does."""
    env = _env(environ)
    return env.get(name, "") if env.get(TEST_HOOKS_ENV) == "1" else ""


def check_job_environment(environ: Optional[Mapping[str, str]] = None, announce: bool = False) -> None:
    """The job variables read once at start (nagmoe.settings.check_start_settings). `announce` (the commands,
    once per process; not the Trainer, which an experiment builds once per run): a test hook set without the
    switch is named in a warning (it does nothing)."""
    env = _env(environ)
    slurm_restart_count(env)
    launched_by_torchrun(env)
    ignored = sorted(k for k in env if k.startswith(TEST_HOOK_PREFIX) and env.get(k))
    if announce and ignored and env.get(TEST_HOOKS_ENV) != "1":
        log.warning("ignoring test hook(s) %s: they act only under %s=1", shown(", ".join(ignored), 200),
                    TEST_HOOKS_ENV)


def describe_environment(environ: Optional[Mapping[str, str]] = None) -> str:
    """One line of the variables that decide ports, threads, imports and collectives (an allow-list)."""
    env = _env(environ)
    names = sorted(k for k in env if k in LOGGED or k.startswith(LOGGED_PREFIXES))
    return " ".join(f"{k}={shown(env[k], 120)}" for k in names) or "(none of the logged variables set)"
