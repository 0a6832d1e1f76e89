"""One writer per run dir: a lease file that the training job holds while it runs.

    RUN_DIR/lease.json   {"host", "pid", "slurm_job_id", "token", "acquired", "refreshed"}

The trainer (rank 0 of a job) takes the lease before it touches anything in the run dir and a background
thread rewrites it every NAGMOE_LEASE_REFRESH_S seconds (default 5) — also while the main thread loads,
saves, evaluates or compiles. A second trainer exits 2 naming the holder. The lease is taken over when

  * it has not been refreshed for NAGMOE_LEASE_STALE_S seconds (default 600: its holder died or hangs),
  * it is held by the same Slurm job id (a requeued job, maybe on another node),
  * its holder is a process of this host that no longer exists (a kill -9 and an immediate restart),
  * or with `--force`.

Staleness is judged by the newer of the refresh time written in the file and the file's mtime, so a clock
difference between nodes only matters beyond that margin. Readers (eval, generate, analyze, report) never
take the lease. On a file system where two nodes race to create the file at the same moment, the later
rename wins; the loser sees another token at its next refresh and stops refreshing (it warns; the holder's
writes are then the run's).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Optional

from nagmoe.errors import UserError
from nagmoe.safe_files import write_atomic
from nagmoe.settings import lease_intervals

LEASE_FILE = "lease.json"

log = logging.getLogger("nagmoe.checkpoint")


def read_lease(run_dir: str) -> Optional[dict]:
    """The lease file's content (None when absent or unreadable: a torn write is treated as no lease)."""
    try:
        with open(os.path.join(run_dir, LEASE_FILE)) as f:
            holder = json.load(f)
        holder["mtime"] = os.path.getmtime(os.path.join(run_dir, LEASE_FILE))
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"{holder.get('host')} pid {holder.get('pid')}{job}"


class RunDirLease:
    """`acquire()` before writing the run dir, `release()` at the end (also on errors)."""

    def __init__(self, run_dir: str, force: bool = False):
        self.run_dir, self.force = run_dir, force
        self.path = os.path.join(run_dir, LEASE_FILE)
        self.refresh_s, self.stale_s = lease_intervals()
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None, "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost = False

    def takeover_reason(self, holder: dict) -> Optional[str]:
        """Why an existing lease may be taken (None: it may not)."""
        age = time.time() - max(float(holder.get("refreshed", 0) or 0), float(holder.get("mtime", 0)))
        if self.force:
            return "--force"
        if age >= self.stale_s:
            return f"not refreshed for {age:.0f} s"
        if self.me["slurm_job_id"] and holder.get("slurm_job_id") == self.me["slurm_job_id"]:
            return "same Slurm job (requeued)"
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            if holder["pid"] == self.me["pid"]:
                return "this process"
            if not _pid_alive(holder["pid"]):
                return "its process no longer exists"
        return None

    def acquire(self) -> "RunDirLease":
        os.makedirs(self.run_dir, exist_ok=True)
        holder = read_lease(self.run_dir)
        if holder is not None and holder.get("token") != self.me["token"]:
            reason = self.takeover_reason(holder)
            if reason is None:
                age = time.time() - max(float(holder.get("refreshed", 0) or 0), float(holder.get("mtime", 0)))
                raise UserError(f"{self.run_dir}: in use by {describe(holder)} (lease {self.path} refreshed "
                                f"{age:.0f} s ago); one trainer per run dir: wait for it to end, or pass --force "
                                f"if it is gone (a lease is stale after {self.stale_s:.0f} s)")
            log.warning("taking over the lease of %s from %s: %s", self.run_dir, describe(holder), reason)
        self.me["acquired"] = time.time()
        self._write()
        self._thread = threading.Thread(target=self._refresh_loop, name="nagmoe-lease", daemon=True)
        self._thread.start()
        return self

    def _write(self) -> None:  # a fresh temporary, renamed (nagmoe.safe_files): never a planted name
        write_atomic(self.path, json.dumps({**self.me, "refreshed": time.time()}))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            holder = read_lease(self.run_dir)
            if holder is not None and holder.get("token") != self.me["token"]:
                self.lost = True
                log.warning("lease of %s was taken over by %s: no longer refreshing it", self.run_dir,
                            describe(holder))
                return
            try:
                self._write()
            except OSError as e:  # a file-system hiccup: try again at the next refresh
                log.warning("could not refresh the lease %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        holder = read_lease(self.run_dir)
        if holder is not None and holder.get("token") == self.me["token"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
