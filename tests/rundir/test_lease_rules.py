"""Issue 41, the lease's rules (real files, real processes for the pid checks): two `srun nagmoe train` steps of
one Slurm allocation never take each other's lease, a requeue (SLURM_RESTART_COUNT increased) or a gone holder
does; a lease dated beyond the stale interval in the future is stale, one within it counts as refreshed now;
a lease.json that is not a lease is stale with a warning naming it, never a traceback; messages are bounded;
`confirm()` (the fence) names the new holder once the lease was taken over."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from nagmoe.rundir.lease import LEASE_FILE, RunDirLease, read_lease
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALE_S = 60
HOLDER = """
import sys, time
from nagmoe.rundir.lease import RunDirLease
lease = RunDirLease(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(30)
"""


@pytest.fixture(autouse=True)
def environment(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NAGMOE_LEASE_STALE_S", str(STALE_S))


@pytest.fixture
def step_of_job_77(tmp_path):
    """A live process of Slurm job 77 (restart count 0) holding the lease of tmp_path/run."""
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": REPO, "SLURM_JOB_ID": "77", "NAGMOE_LEASE_REFRESH_S": "0.3"}
    env.pop("SLURM_RESTART_COUNT", None)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield run_dir, proc
    finally:
        proc.kill()
        proc.wait()


def write_lease(run_dir, refreshed, **fields):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LEASE_FILE)
    with open(path, "w") as f:
        json.dump({"host": "node-17", "pid": 4242, "slurm_job_id": None, "token": "theirs", "refreshed": refreshed,
                   **fields}, f)
    os.utime(path, (refreshed, refreshed))
    return path


def test_another_step_of_the_same_allocation_is_refused(step_of_job_77, monkeypatch):
    run_dir, proc = step_of_job_77
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a second `srun nagmoe train` of the same job, not a requeue
    with pytest.raises(UserError, match=f"in use by .* pid {proc.pid}, Slurm job '77'"):
        RunDirLease(run_dir).acquire()
    assert read_lease(run_dir)["pid"] == proc.pid


def test_a_requeued_job_takes_the_lease_and_records_its_restart_count(step_of_job_77, monkeypatch):
    run_dir, _ = step_of_job_77
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lease = RunDirLease(run_dir).acquire()
    try:
        held = read_lease(run_dir)
        assert held["token"] == lease.me["token"] and held["slurm_restart_count"] == 1
    finally:
        lease.release()


def test_the_same_job_takes_the_lease_of_its_gone_process(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    write_lease(run_dir, time.time(), host=socket.gethostname(), pid=dead.pid, slurm_job_id="77",
                slurm_restart_count=0)
    RunDirLease(run_dir).acquire().release()


def test_a_lease_dated_beyond_the_stale_interval_in_the_future_is_stale(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, time.time() + 2 * STALE_S)  # a node whose clock is wrong by hours
    lease = RunDirLease(run_dir).acquire()
    assert read_lease(run_dir)["token"] == lease.me["token"]
    lease.release()


def test_a_lease_dated_within_the_margin_counts_as_refreshed_now(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, time.time() + STALE_S / 2)  # clock skew between nodes: the holder is alive
    with pytest.raises(UserError, match=r"refreshed 0 s ago"):
        RunDirLease(run_dir).acquire()


@pytest.mark.parametrize("content", [b"[1]", b'{"refreshed": "soon"}', b"[" * 100000, b"\xff\xfe{}",
                                     b'{"host": "h", "pid": true, "token": "t", "refreshed": 1}',
                                     b'{"host": "h", "pid": 1, "token": "t", "refreshed": NaN}'],
                         ids=["list", "string-time", "deep", "not-utf8", "bool-pid", "nan-time"])
def test_a_lease_file_that_is_not_a_lease_is_stale_with_a_warning(tmp_path, caplog, content):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LEASE_FILE).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="nagmoe.checkpoint"):
        lease = RunDirLease(str(run_dir)).acquire()
    try:
        assert read_lease(str(run_dir))["token"] == lease.me["token"]
    finally:
        lease.release()
    warned = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(warned) == 1 and LEASE_FILE in warned[0] and len(warned[0]) < 1000, warned


def test_messages_about_a_huge_host_name_are_bounded(tmp_path):
    run_dir = str(tmp_path / "run")
    write_lease(run_dir, time.time(), host="h" * 100000, slurm_job_id="j" * 100000)
    with pytest.raises(UserError) as info:
        RunDirLease(run_dir).acquire()
    assert "in use by 'hhh" in str(info.value) and len(str(info.value)) < 1000


def test_confirm_is_the_fence_naming_the_new_holder(tmp_path):
    run_dir = str(tmp_path / "run")
    mine = RunDirLease(run_dir).acquire()
    mine.confirm()  # still ours: no error
    theirs = RunDirLease(run_dir, take_over=True).acquire()
    theirs.me["pid"] = 99999999  # another trainer's process, as the message shows it
    theirs._write()
    try:
        with pytest.raises(UserError, match=r"taken over by '.*' pid 99999999"):
            mine.confirm()
        mine.release()  # gives back nothing that is not ours
        assert read_lease(run_dir)["token"] == theirs.me["token"]
    finally:
        theirs.release()
