"""Run a test function on N gloo ranks, each a fresh Python process with an explicit environment.

`run_ranks(path, function, world_size, args, env, tmp, timeout)` starts `world_size` processes of this file
(torchrun-style RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, OMP_NUM_THREADS=1, plus `env`: the
DeepSpeed variables); each initialises the process group with nagmoe.parallel.env, imports the module at
`path`, calls `function(*args)` and pickles the result. Returns the results by rank. A rank that fails or
exits without a result fails the call with the tail of its stderr (the other ranks are killed rather than
left hanging); a hang fails after `timeout` seconds.

Fresh processes (not forks of the pytest process) so that DeepSpeed reads DS_ACCELERATOR and
TORCH_EXTENSIONS_DIR from a clean environment and its module-global communication state starts empty.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
               "SLURM_NODELIST", "SLURM_JOB_ID")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _requires_deepspeed():
    """deepspeed is an optional extra: its tests skip where it is not installed, except in CI (which installs
    it, so a broken install fails there instead of skipping)."""
    import pytest

    missing = importlib.util.find_spec("deepspeed") is None
    return pytest.mark.skipif(missing and not os.environ.get("CI"),
                              reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install 'deepspeed==0.19.8'); "
                                     "CI installs it")


requires_deepspeed = _requires_deepspeed()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                   p for p in (REPO, env.get("PYTHONPATH")) if p))
    return env


def run_ranks(path: str, function: str, world_size: int, args: tuple, env: dict, tmp: str,
              timeout: float = 240.0) -> list:
    os.makedirs(tmp, exist_ok=True)
    args_file = os.path.join(tmp, f"{function}.args.pkl")
    with open(args_file, "wb") as f:
        pickle.dump(args, f)
    port = free_port()
    procs, logs = [], []
    for r in range(world_size):
        log = open(os.path.join(tmp, f"{function}.rank{r}.log"), "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), path, function, args_file,
                                       _result_file(tmp, function, r)], stdout=log, stderr=subprocess.STDOUT,
                                      env=rank_env(r, world_size, port, env), cwd=REPO))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                raise AssertionError(f"rank {failed[0]} exited with code {procs[failed[0]].returncode}:\n"
                                     f"{_tail(logs[failed[0]])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish in {timeout:.0f} s; rank 0:\n{_tail(logs[0])}")
            time.sleep(0.2)
        for r, p in enumerate(procs):
            if p.returncode != 0 or not os.path.isfile(_result_file(tmp, function, r)):
                raise AssertionError(f"rank {r} exited with code {p.returncode}:\n{_tail(logs[r])}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    results = []
    for r in range(world_size):
        with open(_result_file(tmp, function, r), "rb") as f:
            results.append(pickle.load(f))
    return results


def _result_file(tmp: str, function: str, rank: int) -> str:
    return os.path.join(tmp, f"{function}.rank{rank}.pkl")


def _tail(log, chars: int = 6000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def _main(path: str, function: str, args_file: str, result_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed

    spec = importlib.util.spec_from_file_location(f"_ds_rank_{function}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(args_file, "rb") as f:
        args = pickle.load(f)
    env = read_dist_env()
    init_distributed(env, torch.device("cpu"), timeout_s=180)
    try:
        result = getattr(module, function)(*args)
    finally:
        shutdown_distributed()
    with open(result_file + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(result_file + ".tmp", result_file)


if __name__ == "__main__":
    try:
        _main(*sys.argv[1:5])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
