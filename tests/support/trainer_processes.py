"""Helpers of the recovery tests: start `nagmoe train` as real processes (one, or N ranks launched the way
`srun` launches them), kill them at chosen moments, and compare what a run left behind with a reference.

Every process runs with OMP_NUM_THREADS=1: default torch threading on two shared cores makes a micro step
~100x slower, and the thread count must match across runs for bitwise comparisons anyway.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

import pytest

from nagmoe.rundir.metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CRASH_DRIVER = os.path.join(HERE, "crash_driver.py")
# Variables of a surrounding launcher that must not leak into the test processes.
LAUNCHER_VARS = re.compile(r"^(SLURM_|SBATCH_|SRUN_|TORCHELASTIC_|RANK$|WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$"
                           r"|GROUP_RANK$|MASTER_ADDR$|MASTER_PORT$|NAGMOE_DIST_TIMEOUT_S$)")
# the only metrics that may differ between identical runs: the throughput and the loop's own time (issue 67)
TIMING_KEYS = ("tokens_per_s", "step_s", "data_wait_s", "loop_s", "peak_memory_gib")

# The soak variant of the suite's micro config: sequences of 64 tokens, 512-token batches (8 rows), 120 steps
# with a checkpoint every 10 and an eval every 40. SHORT runs the first 30 steps of the same schedule
# (`train.max_steps` is a stop only; the LR follows `train.schedule_steps`), so its records equal the
# reference's first 30 (but for the final eval). DIST: SHORT on two ranks with the experts sharded over both
# (EP=2), so each checkpoint holds one shard file per rank.
SOAK = ("train.batch_tokens=512", "train.schedule_steps=120", "train.max_steps=120", "train.checkpoint_every=10",
        "train.eval_every=40", "log.every=1")
SHORT_STEPS = 30
SHORT = (*SOAK, f"train.max_steps={SHORT_STEPS}")
DIST = (*SHORT, "parallel.ep=2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def train_args(config: str, run_dir: str, *more: str) -> list[str]:
    return ["--config", config, "--run-dir", str(run_dir), "--quiet", *more]


def nagmoe_train(*args: str) -> list[str]:
    return [sys.executable, "-m", "nagmoe", "train", *args]


def run_trainer(config: str, run_dir, *more: str, timeout: float = 240, env: Optional[dict] = None):
    """`nagmoe train` to its end; the CompletedProcess (text output captured)."""
    return subprocess.run(nagmoe_train(*train_args(config, run_dir, *more)), cwd=REPO, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(argv: Sequence[str], log_path, env: Optional[dict] = None) -> subprocess.Popen:
    """A process with stdout+stderr going to `log_path` (a pipe nobody reads could fill and block it)."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(list(argv), cwd=REPO, env=env or clean_env(), stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()  # the child holds its own descriptor


def start_ranks(world: int, config: str, run_dir, log_dir, *more: str, env_extra: Optional[dict] = None,
                driver: Optional[Callable[[int], list]] = None):
    """`world` trainer processes launched as srun launches one task per rank (SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID, rendezvous on MASTER_ADDR:MASTER_PORT), without torchrun: a signal reaches the rank
    itself, and a preempted rank exits 75. Returns the processes by rank; logs in LOG_DIR/rank<r>.log.
    `driver(rank)`: the argv that runs `nagmoe train` for that rank, given before the train arguments (the crash
    driver's, e.g.); default `python -m nagmoe train`."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env_extra or {}))
        args = train_args(config, run_dir, *more)
        argv = [*driver(rank), *args] if driver is not None else nagmoe_train(*args)
        procs.append(start(argv, os.path.join(log_dir, f"rank{rank}.log"), env))
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[Optional[int]]:
    """Return codes after waiting up to `timeout` s in all; a process still running then is killed and
    reported as None (a hang)."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    stop_all(procs)
    return codes


def stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """Kill whatever is still running (SIGKILL also ends a stopped process) and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def read_log(path) -> str:
    with open(path) as f:
        return f.read()


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             procs: Sequence[subprocess.Popen] = (), interval: float = 0.005):
    """Poll `predicate` until truthy; fail naming `what` on timeout or when one of `procs` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        ended = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        if ended:
            pytest.fail(f"process {ended[0][0]} exited with code {ended[0][1]} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ----------------------------------------------------------------------------------------------------------
# What a run left behind
# ----------------------------------------------------------------------------------------------------------
def metrics_path(run_dir) -> str:
    return os.path.join(str(run_dir), "metrics.jsonl")


def records(run_dir) -> list[dict]:
    return read_metrics(metrics_path(run_dir))


def logged_steps(run_dir) -> list[int]:
    return [r["step"] for r in records(run_dir) if "step" in r]


def last_logged_step(run_dir) -> int:
    steps = logged_steps(run_dir)
    return steps[-1] if steps else 0


def comparable(recs: list[dict], upto: Optional[int] = None, drop: Sequence[str] = TIMING_KEYS) -> list[dict]:
    """Records without timings (and only steps <= `upto` when given): what identical runs share bitwise."""
    return [{k: v for k, v in r.items() if k not in drop} for r in recs if upto is None or r["step"] <= upto]


def checkpoint_steps(run_dir) -> list[str]:
    root = os.path.join(str(run_dir), "checkpoints")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def loaded_state(checkpoint_path: str, cfg, with_optimizer: bool = True) -> dict:
    """The model (and optimizer) state of a checkpoint, loaded in this process into a fresh model."""
    from nagmoe.model import build_model
    from nagmoe.checkpoint import load_checkpoint
    from nagmoe.train.optim import build_optimizers

    model = build_model(cfg.model)
    optim = build_optimizers(model, cfg.train) if with_optimizer else None
    extra = load_checkpoint(checkpoint_path, model, optim, restore_rng=False)
    extra["progress"] = {k: v for k, v in extra["progress"].items() if k != "wall_s"}
    return {"model": model.state_dict(), "optim": [o.state_dict() for o in optim] if optim else None,
            "extra": extra}


def assert_same_state(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, compared exactly (tensors bit for bit)."""
    import torch

    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
