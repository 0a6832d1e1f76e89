"""One writer per run dir (issue 21, point 7): a live lease held by another process refuses a second trainer
(exit 2, naming the holder); it is refreshed by a thread while the main thread is busy; a stale lease, one of
the same Slurm job when requeued, one whose process is gone and `--take-over` are taken over; readers never take it."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from nagmoe.rundir.lease import LEASE_FILE, RunDirLease, read_lease
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOLDER = """
import sys, time, torch
from nagmoe.rundir.lease import RunDirLease
lease = RunDirLease(sys.argv[1]).acquire()
print("held", flush=True)
deadline = time.time() + float(sys.argv[2])
a = torch.randn(400, 400)
while time.time() < deadline:  # the main thread busy in torch (a load, a save, a compile...)
    a = (a @ a).tanh()
lease.release()
"""


@pytest.fixture
def holder(tmp_path):
    """A real process holding the lease of tmp_path/run for a while (refresh every 0.3 s)."""
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "NAGMOE_LEASE_REFRESH_S": "0.3", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir, "60"], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_a_second_trainer_exits_2_naming_the_holder(holder, micro_config, tmp_path):
    from nagmoe.config import dump_yaml

    run_dir, proc = holder
    config = tmp_path / "config.yaml"
    config.write_text(dump_yaml(micro_config()))
    r = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", str(config), "--run-dir",
                        run_dir, "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert f"in use by {socket.gethostname()!r} pid {proc.pid}" in line and "--take-over" in line
    assert sorted(os.listdir(run_dir)) == [LEASE_FILE]  # nothing written by the refused trainer


def test_the_lease_is_refreshed_while_the_main_thread_is_busy(holder):
    run_dir, _ = holder
    first = read_lease(run_dir)["refreshed"]
    time.sleep(1.5)
    assert read_lease(run_dir)["refreshed"] > first + 0.5


def test_take_over_takes_a_live_lease_and_the_old_holder_stops_refreshing(holder):
    run_dir, proc = holder
    mine = RunDirLease(run_dir, take_over=True).acquire()
    try:
        time.sleep(1.0)  # the holder's refresh thread sees another token and stops writing
        assert read_lease(run_dir)["token"] == mine.me["token"]
    finally:
        mine.release()
    assert not os.path.exists(os.path.join(run_dir, LEASE_FILE))


def write_foreign_lease(run_dir, age_s, **fields):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LEASE_FILE)
    then = time.time() - age_s
    with open(path, "w") as f:
        json.dump({"host": "node-17", "pid": 4242, "slurm_job_id": None, "token": "theirs", "refreshed": then,
                   **fields}, f)
    os.utime(path, (then, then))


@pytest.mark.parametrize("case", ["stale", "same_slurm_job", "dead_local_pid"])
def test_takeover(case, tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("NAGMOE_LEASE_STALE_S", "60")
    if case == "stale":
        write_foreign_lease(run_dir, age_s=61)
    elif case == "same_slurm_job":
        monkeypatch.setenv("SLURM_JOB_ID", "991")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued onto another node (issue 41: not another step)
        write_foreign_lease(run_dir, age_s=1, slurm_job_id="991")
    else:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        write_foreign_lease(run_dir, age_s=1, host=socket.gethostname(), pid=dead.pid)
    lease = RunDirLease(run_dir).acquire()
    assert read_lease(run_dir)["token"] == lease.me["token"]
    lease.release()


def test_a_fresh_foreign_lease_is_refused(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    monkeypatch.setenv("NAGMOE_LEASE_STALE_S", "60")
    monkeypatch.setenv("SLURM_JOB_ID", "992")
    write_foreign_lease(run_dir, age_s=30, slurm_job_id="991")
    with pytest.raises(UserError, match="in use by 'node-17' pid 4242, Slurm job '991'"):
        RunDirLease(run_dir).acquire()
    monkeypatch.setenv("NAGMOE_LEASE_STALE_S", "soon")
    with pytest.raises(UserError, match="NAGMOE_LEASE_STALE_S"):
        RunDirLease(run_dir)


def test_a_trainer_releases_its_lease_and_readers_never_take_one(micro_config, tmp_path):
    """After a run the lease is gone; with another process holding it, eval's loader still reads the run and
    the holder keeps it."""
    import torch

    from nagmoe.eval.generate import load_run
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = str(tmp_path / "run")
    Trainer(micro_config("train.max_steps=2"), run_dir, quiet=True).run()
    assert not os.path.exists(os.path.join(run_dir, LEASE_FILE))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir, "60"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        token = read_lease(run_dir)["token"]
        assert load_run(run_dir).checkpoint.endswith("step_000002")
        assert read_lease(run_dir)["token"] == token
    finally:
        proc.kill()
        proc.wait()
