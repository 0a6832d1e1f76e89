"""One writer per run dir: a lease file that the training job holds while it runs, and checks before it writes.

    RUN_DIR/lease.json   {"host", "pid", "slurm_job_id", "slurm_restart_count", "token", "acquired", "refreshed"}

The trainer (rank 0 of a job) takes the lease before it touches anything in the run dir and a background
thread rewrites it every NAGMOE_LEASE_REFRESH_S seconds (default 5) — also while the main thread loads,
saves, evaluates or compiles. A second trainer exits 2 naming the holder. The lease is taken over when

  * it has not been refreshed for NAGMOE_LEASE_STALE_S seconds (default 600: its holder died or hangs),
  * it is held by the same Slurm job id AND that job was requeued since (SLURM_RESTART_COUNT increased) or
    its holder process is gone (same host, pid not alive): two `srun nagmoe train` steps of one allocation
    share a job id and must not take each other's lease,
  * its holder is a process of this host that no longer exists (a kill -9 and an immediate restart),
  * or with `--take-over` (nagmoe.rundir.permissions).

Staleness is judged by the newer of the refresh time written in the file and the file's mtime, so a clock
difference between nodes only matters beyond that margin; a time in the future within the stale interval is
clamped to now, one beyond it is a wrong clock and the lease is stale. A lease.json that is not a lease (torn,
wrong types, not UTF-8) is stale with a warning naming the file: leases are written atomically, so only a
foreign hand writes such a file.

The lease is a fence (`confirm`): before each checkpoint publish, metrics write and summary.json the holder
checks the file still carries its token; if another trainer took it over, the holder stops with a UserError
naming the new holder (exit 2) and writes nothing more. Readers (eval, generate, analyze, report) never take
the lease.
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

from nagmoe.base.errors import UserError, shown
from nagmoe.base.environment import lease_intervals, slurm_restart_count
from nagmoe.base.files import expect, expect_object, loads_json, read_text, write_atomic
from nagmoe.rundir.names import LEASE_FILE

# the fields a lease must have, and their types
FIELDS = {"host": str, "pid": int, "token": str, "refreshed": (int, float)}
OPTIONAL = {"slurm_job_id": (str, type(None)), "slurm_restart_count": int, "acquired": (int, float)}

log = logging.getLogger("nagmoe.checkpoint")


def _invalid(holder, where: str) -> Optional[str]:
    """Why `holder` (parsed JSON) is not a lease, or None: the project's typed-field check (nagmoe.base.files:
    bool is not a number, a time must be finite — a NaN `refreshed` would never go stale)."""
    try:
        expect_object(holder, where)
        for key, kinds in FIELDS.items():
            expect(holder, key, kinds, where)
        for key, kinds in OPTIONAL.items():
            expect(holder, key, kinds, where, required=False)
    except UserError as e:
        return str(e)
    return None


def read_lease(run_dir: str) -> Optional[dict]:
    """The lease file's content; None when absent. A file that is not a lease gives {"invalid": reason}."""
    path = os.path.join(run_dir, LEASE_FILE)
    if not os.path.lexists(path):
        return None
    try:
        holder = loads_json(read_text(path), shown(path))
        mtime = os.path.getmtime(path)
    except UserError as e:  # unreadable, not UTF-8, not JSON, nested too deeply
        return {"invalid": str(e)}
    except OSError as e:
        return {"invalid": f"{shown(path)}: {e.strerror or type(e).__name__}"}
    reason = _invalid(holder, shown(path))
    return {"invalid": reason} if reason is not None else {**holder, "mtime": mtime}


def read_lease_token(run_dir: str) -> Optional[dict]:
    """The fence's read between steps (issue 67): the lease's content in one path call on the shared file system
    (an open; no existence check, no mtime: the token is all a confirmation compares). None when absent; a file
    that is not a lease gives {"invalid": reason}, as read_lease."""
    path = os.path.join(run_dir, LEASE_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"invalid": f"{shown(path)}: {e.strerror or type(e).__name__}"}
    try:
        holder = loads_json(data.decode("utf-8"), shown(path))
    except UnicodeDecodeError as e:
        return {"invalid": f"{shown(path)}: not UTF-8 text (byte {e.start})"}
    except UserError as e:
        return {"invalid": str(e)}
    reason = _invalid(holder, shown(path))
    return {"invalid": reason} if reason is not None else holder


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # exists, another user's; a pid beyond the platform's range
        return True
    return True


def describe(holder: dict) -> str:
    if "invalid" in holder:
        return "an unreadable lease"
    job = f", Slurm job {shown(holder['slurm_job_id'], 40)}" if holder.get("slurm_job_id") else ""
    return f"{shown(holder.get('host'), 80)} pid {shown(holder.get('pid'), 20)}{job}"


def taken_over_message(run_dir: str, holder: dict) -> str:
    """The one line a trainer stops with once `holder` took its run dir over: the fence's (`confirm`), and a
    publish's whose save directory the new holder moved (nagmoe.checkpoint.publish)."""
    return (f"{shown(run_dir)}: the run dir was taken over by {describe(holder)}; this trainer stops without "
            "writing anything more (one trainer per run dir)")


def other_holder(run_dir: str) -> Optional[dict]:
    """The lease of `run_dir` when another process holds it, else None (no lease, a file that is not a lease, or
    this process's own: the trainer's lease is held by the process that publishes its saves, rank 0)."""
    holder = read_lease(run_dir)
    if holder is None or "invalid" in holder:
        return None
    if holder["host"] == socket.gethostname() and holder["pid"] == os.getpid():
        return None
    return holder


def lease_age(holder: dict, stale_s: float, now: Optional[float] = None) -> float:
    """Seconds since the holder last refreshed: a time in the future within `stale_s` is clamped to now (clock
    skew between nodes); one further ahead is a wrong clock, and the lease counts as stale (inf)."""
    now = time.time() if now is None else now
    last = max(float(holder.get("refreshed", 0)), float(holder.get("mtime", 0)))
    if last - now > stale_s:
        return float("inf")
    return max(0.0, now - last)


class RunDirLease:
    """`acquire()` before writing the run dir, `confirm()` before each publish, `release()` at the end."""

    def __init__(self, run_dir: str, take_over: bool = False):
        self.run_dir, self.take_over = run_dir, take_over
        self.path = os.path.join(run_dir, LEASE_FILE)
        self.refresh_s, self.stale_s = lease_intervals()
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
                   "slurm_restart_count": slurm_restart_count(), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost: Optional[dict] = None  # the holder that took the lease over, once seen

    def takeover_reason(self, holder: dict) -> Optional[str]:
        """Why an existing lease may be taken (None: it may not)."""
        if "invalid" in holder:
            return f"not a lease ({holder['invalid']})"
        if self.take_over:
            return "--take-over"
        age = lease_age(holder, self.stale_s)
        if age >= self.stale_s:
            return "its refresh time is in the future" if age == float("inf") else f"not refreshed for {age:.0f} s"
        same_host = holder["host"] == self.me["host"]
        if same_host and holder["pid"] == self.me["pid"]:
            return "this process"
        gone = same_host and not _pid_alive(holder["pid"])
        if self.me["slurm_job_id"] and holder.get("slurm_job_id") == self.me["slurm_job_id"]:
            if self.me["slurm_restart_count"] > holder.get("slurm_restart_count", 0):
                return "same Slurm job, requeued"
            if gone:
                return "same Slurm job, its process no longer exists"
            return None  # another step of this allocation, alive: not ours to take
        if gone:
            return "its process no longer exists"
        return None

    def acquire(self) -> "RunDirLease":
        os.makedirs(self.run_dir, exist_ok=True)
        holder = read_lease(self.run_dir)
        if holder is not None and holder.get("token") != self.me["token"]:
            reason = self.takeover_reason(holder)
            if reason is None:
                age = lease_age(holder, self.stale_s)
                raise UserError(f"{shown(self.run_dir)}: in use by {describe(holder)} (lease {shown(self.path)} "
                                f"refreshed {age:.0f} s ago); one trainer per run dir: wait for it to end, or pass "
                                f"--take-over if it is gone (a lease is stale after {self.stale_s:.0f} s)")
            log.warning("taking over the lease of %s from %s: %s", shown(self.run_dir), describe(holder), reason)
        self.me["acquired"] = time.time()
        self._write()
        self._thread = threading.Thread(target=self._refresh_loop, name="nagmoe-lease", daemon=True)
        self._thread.start()
        return self

    def _write(self) -> None:  # a fresh temporary, renamed (nagmoe.base.files): never a planted name
        write_atomic(self.path, json.dumps({**self.me, "refreshed": time.time()}))

    def _taken_by(self) -> Optional[dict]:
        """The holder that took the lease from us, or None while it is ours. A missing or unreadable file
        counts as taken: we always rewrite it atomically, so someone else removed or replaced it."""
        if self.lost is not None:
            return self.lost
        holder = read_lease_token(self.run_dir)
        if holder is None:
            holder = {"invalid": f"{shown(self.path)} was removed"}
        if holder.get("token") != self.me["token"]:
            self.lost = holder
        return self.lost

    def confirm(self) -> None:
        """The fence: raise a UserError naming the new holder unless the lease is still ours."""
        holder = self._taken_by()
        if holder is not None:
            self._stop.set()
            raise UserError(taken_over_message(self.run_dir, holder))

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            holder = self._taken_by()
            if holder is not None:
                log.warning("lease of %s was taken over by %s: no longer refreshing it; this trainer stops at "
                            "its next write", shown(self.run_dir), describe(holder))
                return
            try:
                self._write()
            except OSError as e:  # a file-system hiccup: try again at the next refresh
                log.warning("could not refresh the lease %s: %s", shown(self.path), shown(str(e)))

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        holder = read_lease(self.run_dir)
        if holder is not None and holder.get("token") == self.me["token"]:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def fence_on_all_ranks(mesh, lease: Optional[RunDirLease]) -> None:
    """Collective (every rank of `mesh`, a nagmoe.parallel.mesh.ParallelMesh): rank 0, the holder, confirms its
    lease and the verdict is shared, so every rank raises the same UserError together and none waits in a later
    collective. Ranks other than 0 hold no lease (None)."""
    mesh.on_rank0(lambda: lease.confirm() if lease is not None else None)
