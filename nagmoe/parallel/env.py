"""Process-group initialisation from the launcher's environment (torchrun, `srun torchrun`, or plain srun).

Where rank and world come from (DESIGN.md, runtime conventions):
  1. `RANK` / `WORLD_SIZE` / `LOCAL_RANK` when set: torchrun sets them (also under `srun torchrun`); the
     rendezvous is torchrun's own (`env://`: MASTER_ADDR/MASTER_PORT, or the agent's store).
  2. Otherwise `SLURM_PROCID` / `SLURM_NTASKS` / `SLURM_LOCALID` (one srun task per rank); the master is
     `MASTER_ADDR` when set, else the first host of `SLURM_JOB_NODELIST` (`scontrol show hostnames`, or our
     parser when scontrol is absent); the port is `MASTER_PORT`, else derived from `SLURM_JOB_ID` so two
     jobs sharing a node do not collide; rendezvous by `tcp://addr:port`.
  3. Neither: one process, no process group.
Backend: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from nagmoe.base.errors import UserError
from nagmoe.base.environment import DEFAULT_DIST_TIMEOUT_S, DIST_TIMEOUT_ENV, dist_timeout_setting

DEFAULT_PORT = 29500
TIMEOUT_ENV = DIST_TIMEOUT_ENV  # process-group timeout (rendezvous and collectives), seconds, at most 7 days
DEFAULT_TIMEOUT_S = DEFAULT_DIST_TIMEOUT_S  # torch's gloo default
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 20000  # SLURM_JOB_ID -> port in [20000, 40000)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # single | torchrun | slurm
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _int_var(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_ranges(spec: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding kept, as Slurm does)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
        elif item:
            out.append(item)
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm host-list syntax to host names: 'gpu[01-02,5],login' -> ['gpu01', 'gpu02', 'gpu5', 'login'];
    several bracket groups in one name expand as a product ('r[1-2]n[1-2]' -> r1n1, r1n2, r2n1, r2n2)."""
    hosts = []
    for part in _split_top_level(nodelist):
        m = re.search(r"\[([^\]]*)\]", part)
        if m is None:
            hosts.append(part)
            continue
        head, tail = part[:m.start()], part[m.end():]
        for value in _expand_ranges(m.group(1)):
            hosts.extend(expand_nodelist(head + value + tail))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `scontrol show hostnames` when available, else our parser."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10)
            lines = out.stdout.split()
            if out.returncode == 0 and lines:
                return lines[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts[0]


def read_dist_env(environ: Optional[Mapping[str, str]] = None) -> DistEnv:
    """Rank, world size, local rank and rendezvous address from the environment (module docstring)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
        local = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        port = _int_var(env, "MASTER_PORT") if "MASTER_PORT" in env else None
        source = "torchrun"
        addr = env.get("MASTER_ADDR")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS")
        local = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        source = "slurm"
        addr = env.get("MASTER_ADDR")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and world > 1:
            if not nodelist:
                raise UserError("Slurm launch without MASTER_ADDR or SLURM_JOB_NODELIST: cannot find the master")
            addr = first_host(nodelist)
        if "MASTER_PORT" in env:
            port = _int_var(env, "MASTER_PORT")
        elif "SLURM_JOB_ID" in env:
            port = _SLURM_PORT_BASE + _int_var(env, "SLURM_JOB_ID") % _SLURM_PORT_SPAN
        else:
            port = DEFAULT_PORT
    else:
        return DistEnv()
    if world < 1 or not 0 <= rank < world or not 0 <= local < max(world, 1):
        raise UserError(f"inconsistent launch environment ({source}): rank {rank}, world size {world}, "
                        f"local rank {local}")
    return DistEnv(rank, world, local, source if world > 1 else "single", addr, port)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def dist_timeout_s(environ: Optional[Mapping[str, str]] = None) -> float:
    """The process-group timeout in seconds: `NAGMOE_DIST_TIMEOUT_S` when set, else DEFAULT_TIMEOUT_S.

    A peer that dies mid-run is noticed at once (its sockets close and the next collective raises on every
    other rank). The timeout bounds the two cases where nothing closes: a peer that never reaches the
    rendezvous (killed while starting: the others would wait for its store), and a peer that hangs (a frozen
    node, a stuck file system). Keep it above the longest gap between collectives — rank 0 hashes a whole
    checkpoint while the others wait — so the 30-minute default suits large checkpoints."""
    return dist_timeout_setting(environ)


def init_distributed(env: DistEnv, device: torch.device, timeout_s: Optional[float] = None) -> bool:
    """Initialise the default process group for `env` (no-op for one process or when one exists already).
    `timeout_s`: rendezvous and collective timeout, default `dist_timeout_s()`. Returns whether this call
    created the group (then `shutdown_distributed()` should end it)."""
    if not env.distributed or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a hung or failed NCCL collective tears the process down (after the timeout) instead of hanging it
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    timeout = datetime.timedelta(seconds=dist_timeout_s() if timeout_s is None else timeout_s)
    backend = backend_for(device)
    if env.source == "torchrun":  # torchrun's rendezvous (it may own the store on MASTER_PORT already)
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size, timeout=timeout)
    return True


def group_timeout() -> datetime.timedelta:
    """The default process group's timeout (what `init_distributed` set), for the groups created after it."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):  # another backend or torch version: the configured value
        return datetime.timedelta(seconds=dist_timeout_s())


def rank_hosts() -> list:
    """Each rank's host name, by rank (one all_gather_object at start; the host alone without a process
    group): run_info.json says where every rank ran, the first thing to ask of a multi-node failure."""
    import platform

    host = platform.node()
    if not (dist.is_available() and dist.is_initialized()):
        return [host]
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    return hosts


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
