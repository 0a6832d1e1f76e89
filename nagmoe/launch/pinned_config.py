"""The submitted config is pinned (issue 41): `launch`/`experiment --slurm` write it as
RUN_DIR/slurm/config-<sha12>.yaml, named by its content, and the job script trains that file with
`--config-sha256`, so a later `nagmoe launch` on the run dir cannot change what a pending or requeued job trains.

Submitted job ids go to RUN_DIR/slurm/jobs.jsonl ({"job_id", "config_sha256", "submitted"} a line); relaunching
the run dir with ANOTHER config while one of them is pending or running (squeue) is refused unless
--despite-live-job: two jobs with two configs would take turns on one run dir.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time

from nagmoe.base.errors import UserError, shown, warn
from nagmoe.rundir.names import JOBS_FILE, SLURM_DIR
from nagmoe.base.files import open_append, write_atomic


def config_sha256(config_yaml: str) -> str:
    return hashlib.sha256(config_yaml.encode("utf-8")).hexdigest()


def pinned_name(sha256: str) -> str:
    return f"config-{sha256[:12]}.yaml"


def write_pinned(run_dir: str, config_yaml: str) -> str:
    """RUN_DIR/slurm/config-<sha12>.yaml (rewritten atomically with the same content if present); its path."""
    folder = os.path.join(os.path.abspath(run_dir), SLURM_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, pinned_name(config_sha256(config_yaml)))
    write_atomic(path, config_yaml, durable=True)
    return path


def record_job(run_dir: str, job_id: str, sha256: str) -> None:
    path = os.path.join(os.path.abspath(run_dir), SLURM_DIR, JOBS_FILE)
    with open_append(path) as f:
        f.write(json.dumps({"job_id": str(job_id), "config_sha256": sha256, "submitted": time.time()}) + "\n")


def recorded_jobs(run_dir: str) -> list:
    """[(job id, config sha256)] of RUN_DIR/slurm/jobs.jsonl; lines that are not such records are skipped (the
    file is only advisory: a torn last line must not block a launch)."""
    path = os.path.join(os.path.abspath(run_dir), SLURM_DIR, JOBS_FILE)
    out = []
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("job_id"), str) and isinstance(rec.get("config_sha256"), str):
            out.append((rec["job_id"], rec["config_sha256"]))
    return out


def queued_job_ids():
    """The ids squeue lists (pending, running, requeued, completing), or None when squeue is absent or fails."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-o", "%i"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def check_relaunch(run_dir: str, sha256: str, despite_live_job: bool = False) -> None:
    """Refuse to submit another config for a run dir while one of its recorded jobs is still queued/running."""
    others = [(job, sha) for job, sha in recorded_jobs(run_dir) if sha != sha256]
    if not others:
        return
    queued = queued_job_ids()
    if queued is None:
        warn(f"{shown(run_dir)}: squeue is not available, so whether its earlier job(s) "
             f"{', '.join(shown(j, 20) for j, _ in others[-3:])} still run is unknown; submitting anyway")
        return
    live = [job for job, _ in others if job in queued]
    if live and not despite_live_job:
        raise UserError(f"{shown(run_dir)}: job(s) {', '.join(shown(j, 20) for j in live[:5])} of another config "
                        "are pending or running on this run dir; wait for them or scancel them, or pass "
                        "--despite-live-job")
