"""Preemption without Slurm: a signal to `nagmoe train` checkpoints, writes the marker and exits 75; the next
start resumes with every step logged once; under torch.distributed one rank's request stops all ranks."""
import json
import os
import signal
import subprocess
import sys

import pytest

from slurm_cluster import wait_until
from nagmoe.checkpoint import latest_valid_checkpoint
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.preemption import EXIT_PREEMPTED, MARKER_FILE, REQUEST_FILE, PreemptionWatch, read_marker

pytestmark = pytest.mark.slurm


def logged_steps(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    return [r["step"] for r in read_metrics(path) if "step" in r] if os.path.isfile(path) else []


def test_sigusr1_checkpoints_and_the_restart_logs_every_step_once(micro_yaml, tmp_path):
    steps = 200
    config = micro_yaml(f"train.max_steps={steps}", f"train.schedule_steps={steps}")
    run = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nagmoe", "train", "--config", config, "--run-dir", run,
                             "--quiet"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(logged_steps(run)) >= 3 or proc.poll() is not None, 120, "three logged steps")
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err
    marker = read_marker(run)
    stopped = marker["step"]
    assert marker["reason"] == "SIGUSR1" and 3 <= stopped < steps
    assert latest_valid_checkpoint(run) == marker["checkpoint"] and marker["checkpoint"].endswith(f"{stopped:06d}")
    assert logged_steps(run) == list(range(1, stopped + 1))
    assert "Traceback" not in err

    again = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", config, "--run-dir", run, "--quiet"],
                           env=env, capture_output=True, text=True, timeout=300)  # resumes at the marker's step
    assert again.returncode == 0, again.stderr
    assert logged_steps(run) == list(range(1, steps + 1))  # none lost, none repeated
    with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["steps"] == steps
    assert read_marker(run) is None  # the resumed run dropped the marker


# ----------------------------------------------------------------------------------------------------------
# This rank's part (every rank's agreement at the next sync step: tests/train/test_step_decisions.py)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_signal_is_this_ranks_request(tmp_path, signum):
    for rank in (0, 1):
        watch = PreemptionWatch(str(tmp_path), rank).install()
        try:
            assert not watch.local_request()
            os.kill(os.getpid(), signum)
            assert watch.local_request() and watch.local_reason() == signal.Signals(signum).name
        finally:
            watch.uninstall()
    assert signal.getsignal(signum) is signal.SIG_DFL


def test_only_rank_0_stats_the_request_file(tmp_path):
    from nagmoe.train.preemption import request_stop

    request_stop(str(tmp_path), "test")
    assert PreemptionWatch(str(tmp_path), 0).local_request()
    assert not PreemptionWatch(str(tmp_path), 1).local_request()  # one stat for the job: the run dir is shared


def test_request_file_is_consumed_with_the_marker(tmp_path):
    from nagmoe.train.preemption import Preempted, request_stop

    run = str(tmp_path)
    watch = PreemptionWatch(run).install()
    try:
        assert not watch.local_request()
        request_stop(run, "test")
        assert watch.local_request() and watch.local_reason() == REQUEST_FILE
        with pytest.raises(Preempted) as info:
            watch.stop(lambda: os.path.join(run, "checkpoints", "step_000004"), 4)
    finally:
        watch.uninstall()
    assert info.value.code == EXIT_PREEMPTED and info.value.step == 4
    assert not os.path.exists(os.path.join(run, REQUEST_FILE))
    assert json.load(open(os.path.join(run, MARKER_FILE)))["reason"] == REQUEST_FILE
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handlers restored
