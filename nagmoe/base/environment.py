"""Settings that describe the machine or cluster rather than the experiment, read from the environment
(NAGMOE_DIST_TIMEOUT_S, NAGMOE_DIST_TRAIN_TIMEOUT_S, NAGMOE_LEASE_*, NAGMOE_HANG_*): a bad value is a UserError
naming the variable (exit 2).

Every number is finite, positive and bounded above well below what Python's timers take (`Event.wait` and
`timedelta` overflow near 9.2e9 s): a timeout or a stale interval at most 7 days, a refresh at most 1 day, and
the lease's refresh at most a third of its stale interval (else a live holder's lease goes stale between two
refreshes). No lower bounds beyond > 0: the tests run with sub-second values. `check_start_settings()` reads
them all once at the start of `nagmoe train`, `launch` and `experiment`, before anything is written.

What a job learns from its environment (Slurm and torchrun variables), validated: a bad value is a
UserError naming the variable (exit 2) at start, before anything is written.

sbatch's default `--export=ALL` carries the submitting shell into the job, and a login shell may hold
variables of an earlier job or of a test: so a variable is believed only when the set it belongs to is
consistent (torchrun sets TORCHELASTIC_RUN_ID together with its rank variables), and test hooks act only under
NAGMOE_TEST_HOOKS=1."""
from __future__ import annotations

import logging
import math
import os
from typing import Mapping, Optional

from nagmoe.base.errors import UserError, shown

DAY_S = 86400.0
WEEK_S = 7 * DAY_S


def env_seconds(name: str, default: float, environ: Optional[Mapping[str, str]] = None,
                upper: float = WEEK_S) -> float:
    """A positive, finite number of seconds, at most `upper`, from environment variable `name`; `default` when
    unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw) if len(raw) <= 64 else -1.0
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"environment variable {name}={shown(raw, 60)} must be a positive number of seconds")
    if value > upper:
        raise UserError(f"environment variable {name}={shown(raw, 60)} is more than {upper:.0f} s "
                        f"({upper / DAY_S:.0f} day(s)), the most it may be")
    return value


LEASE_REFRESH_ENV, LEASE_STALE_ENV = "NAGMOE_LEASE_REFRESH_S", "NAGMOE_LEASE_STALE_S"
DEFAULT_LEASE_REFRESH_S, DEFAULT_LEASE_STALE_S = 5.0, 600.0
DIST_TIMEOUT_ENV, DEFAULT_DIST_TIMEOUT_S = "NAGMOE_DIST_TIMEOUT_S", 1800.0  # torch's gloo default
# the collectives' timeout once the first step is done (the first step, saves and evaluations keep the one above);
# torchtitan uses 100 s after the first step; below the watchdog's 180 s floor, so NCCL's own timeout (and its
# flight-recorder dump) comes first. Set it equal to NAGMOE_DIST_TIMEOUT_S for one timeout throughout.
DIST_TRAIN_TIMEOUT_ENV, DEFAULT_DIST_TRAIN_TIMEOUT_S = "NAGMOE_DIST_TRAIN_TIMEOUT_S", 100.0


HANG_LONG_PHASE_ENV, HANG_TERM_GRACE_ENV = "NAGMOE_HANG_LONG_PHASE_S", "NAGMOE_HANG_TERM_GRACE_S"
# the first step (compilation) and checkpoint saves / evaluations get at least this; after a SIGTERM with no
# progress, the process ends after this grace: inside Slurm's default KillWait of 30 s
DEFAULT_HANG_LONG_PHASE_S, DEFAULT_HANG_TERM_GRACE_S = 900.0, 20.0


def hang_allowances(environ: Optional[Mapping[str, str]] = None) -> tuple[float, float]:
    """(long_phase_s, term_grace_s) of the progress watchdog (nagmoe/train/hang_watchdog.py): the allowance of
    the first step, a checkpoint save or an evaluation, and how long after a SIGTERM a step may stay blocked."""
    return (env_seconds(HANG_LONG_PHASE_ENV, DEFAULT_HANG_LONG_PHASE_S, environ, upper=DAY_S),
            env_seconds(HANG_TERM_GRACE_ENV, DEFAULT_HANG_TERM_GRACE_S, environ, upper=DAY_S))


def lease_intervals(environ: Optional[Mapping[str, str]] = None) -> tuple[float, float]:
    """(refresh_s, stale_s) of the run-dir lease: how often the holder rewrites it, and how long unrefreshed
    before another trainer may take it over. refresh <= stale / 3, so a live holder refreshes at least twice
    more within the stale interval after any one late refresh."""
    refresh = env_seconds(LEASE_REFRESH_ENV, DEFAULT_LEASE_REFRESH_S, environ, upper=DAY_S)
    stale = env_seconds(LEASE_STALE_ENV, DEFAULT_LEASE_STALE_S, environ, upper=WEEK_S)
    if refresh > stale / 3 * (1 + 1e-9):  # (a rounding margin: 0.05 and 0.15 are related as asked)
        raise UserError(f"environment variables {LEASE_REFRESH_ENV}={refresh:g} and {LEASE_STALE_ENV}={stale:g}: "
                        f"the refresh interval must be at most a third of the stale interval, or a live trainer's "
                        f"lease goes stale")
    return refresh, stale


def dist_timeout_setting(environ: Optional[Mapping[str, str]] = None) -> float:
    """NAGMOE_DIST_TIMEOUT_S (process-group timeout, seconds; nagmoe.parallel.env.dist_timeout_s)."""
    return env_seconds(DIST_TIMEOUT_ENV, DEFAULT_DIST_TIMEOUT_S, environ)


def dist_train_timeout_setting(environ: Optional[Mapping[str, str]] = None) -> float:
    """NAGMOE_DIST_TRAIN_TIMEOUT_S (the collectives' timeout after the first step;
    nagmoe.parallel.collective_timeouts)."""
    return env_seconds(DIST_TRAIN_TIMEOUT_ENV, DEFAULT_DIST_TRAIN_TIMEOUT_S, environ)


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CPU_ISA_ENVS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # torch's kernel choice


def inductor_cache_per_cpu_isa(environ=None) -> Optional[str]:
    """A compiled CPU kernel from torch's inductor cache is not keyed on ATEN_CPU_CAPABILITY (torch 2.13): one
    compiled under the machine's own capability and loaded by a process capped at `avx2` gave NaN (the fused NAG
    update under bf16; docs/decisions.md). When any of CPU_ISA_ENVS is set and TORCHINDUCTOR_CACHE_DIR is not,
    point the cache at a directory of its own for those values (inherited by child processes); returns it, or
    None when nothing changed. Uncapped processes keep torch's default directory."""
    import getpass
    import re
    import tempfile

    env = os.environ if environ is None else environ
    values = [env.get(name, "") for name in CPU_ISA_ENVS]
    if env.get(INDUCTOR_CACHE_ENV) or not any(values):
        return None
    tag = "-".join(re.sub(r"[^A-Za-z0-9_.]", "_", v[:32]) or "unset" for v in values)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    path = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_isa-{tag}")
    env[INDUCTOR_CACHE_ENV] = path
    return path


def check_start_settings(environ: Optional[Mapping[str, str]] = None, announce: bool = False) -> None:
    """Every NAGMOE_* machine setting (and the job variables of nagmoe.base.environment) read, so a bad one is one
    line at start rather than a failure hours in. `announce`: also warn of ignored test hooks (the commands do,
    once; the Trainer only validates, for API users)."""
    lease_intervals(environ)
    dist_timeout_setting(environ)
    dist_train_timeout_setting(environ)
    hang_allowances(environ)
    check_job_environment(environ, announce)


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
    """The job variables read once at start (nagmoe.base.environment.check_start_settings). `announce` (the commands,
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
