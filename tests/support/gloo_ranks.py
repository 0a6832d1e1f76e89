"""Run a function on N real gloo processes (rendezvous through our own env/init code).

`run_on_ranks(fn, world_size, *args)` starts `world_size` processes (forked from a forkserver that has torch and
nagmoe imported, no process group of its own); each sets the launcher's variables (torchrun style
RANK/WORLD_SIZE/LOCAL_RANK, or Slurm style SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with SLURM_JOB_NODELIST),
initialises the process group with `nagmoe.parallel.env`, calls `fn(*args)` and sends back its (picklable,
tensor-free) result; `pg_timeout_s` is the process group's timeout. Returns the results by rank. A failing rank
fails the call at once with its traceback (the others are killed rather than left hanging); a hang fails after
`timeout` seconds."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
               "SLURM_NODELIST", "SLURM_JOB_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, style, args, results, pg_timeout_s):
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    if style == "slurm":
        os.environ.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank),
                          SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
    else:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed

        env = read_dist_env()
        assert env.rank == rank and env.world_size == world_size and env.source == style, env
        init_distributed(env, torch.device("cpu"), timeout_s=pg_timeout_s)
        try:
            out = fn(*args)
        finally:
            shutdown_distributed()
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))


def _context():
    """forkserver with torch and nagmoe preloaded: the server imports them once per session and every rank
    is a fork of it (a fresh `spawn` would import torch again in each process, seconds per rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "nagmoe.parallel.env", "nagmoe.train.trainer"])
    return ctx


def run_on_ranks(fn, world_size: int, *args, style: str = "torchrun", timeout: float = 180.0,
                 pg_timeout_s: float = 120.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, style, args, results, pg_timeout_s),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if dead:  # died without reporting (killed, segfault); give a late report a moment
                    time.sleep(1.0)
                    if results.empty():
                        raise AssertionError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                             "without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} gloo ranks did not finish in {timeout:.0f} s "
                                       f"(finished: {sorted(out)})") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
