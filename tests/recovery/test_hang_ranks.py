"""A rank whose peer stops answering (a host lost, a partition: here the peer is SIGSTOPped, so its sockets stay
open and nothing errors) blocks in the next collective. The progress watchdog ends it in bounded time with one
line naming rank, host and last step, every thread's stack in its log, and exit code 76; a SIGTERM to the hung
rank ends it within the grace; the run then resumes from its last checkpoint with every step logged once
(issue 51 item 4). Without the watchdog the rank stays blocked for the process group's timeout (30 min)."""
import os
import signal
import time

import pytest

from nagmoe.train.hang_watchdog import EXIT_HUNG
from trainer_processes import (SHORT_STEPS, last_logged_step, logged_steps, read_log, start_ranks, stop_all,
                                 wait_all, wait_for)

HANG_S = 4.0  # train.hang_timeout_s of the first test: a micro step takes ~0.1 s
# a metrics line every step (the legacy cadence): the tests stop rank 1 between two steps seen in metrics.jsonl,
# not at a sync step, where a checkpoint save (its long-phase allowance) could hold the watchdog off
EVERY_STEP = "train.sync_every=1"


def _stop_rank_1_after_step(procs, run_dir, step):
    wait_for(lambda: last_logged_step(run_dir) >= step, 180, f"step {step} on two ranks", procs)
    os.kill(procs[1].pid, signal.SIGSTOP)  # alive, silent: rank 0's next collective never completes
    return time.monotonic(), last_logged_step(run_dir)


@pytest.mark.distributed
def test_a_rank_blocked_on_a_silent_peer_exits_76_naming_itself_and_the_run_resumes(dist_reference, tmp_path):
    run_dir = str(tmp_path / "run")
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), f"train.hang_timeout_s={HANG_S}",
                        EVERY_STEP)
    try:
        stopped_at, step = _stop_rank_1_after_step(procs, run_dir, 12)
        code = procs[0].wait(timeout=120)
        waited = time.monotonic() - stopped_at
    finally:
        stop_all(procs)  # SIGKILL ends the stopped rank too
    log = read_log(tmp_path / "rank0.log")
    assert code == EXIT_HUNG, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("[nagmoe] rank 0 on ")]
    assert len(lines) == 1 and f"hung after step {step}" in lines[0] and "no progress for" in lines[0], lines
    print(f"[line] {lines[0]}")
    assert "; rank 1 on " in lines[0] and " silent since step " in lines[0], lines  # the culprit (issue 61)
    assert "Current thread" in log and "File " in log  # the stacks: where the main thread was blocked
    assert "Traceback" not in log
    assert HANG_S <= waited < HANG_S + 30, waited  # bounded: the limit plus the check interval and the exit

    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path))  # a restart, as the job would do
    try:
        codes = wait_all(procs, timeout=240)
    finally:
        stop_all(procs)
    assert codes == [0, 0], [read_log(tmp_path / f"rank{r}.log")[-2000:] for r in range(2)]
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))  # from the last checkpoint, each step once


@pytest.mark.distributed
def test_a_sigterm_to_a_hung_rank_ends_it_within_the_grace(dist_reference, tmp_path):
    """The preemption handler waits for a step boundary that never comes; the watchdog's grace ends it (the
    hang limit here is far away: only the SIGTERM path can end the process)."""
    run_dir = str(tmp_path / "run")
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), "train.hang_timeout_s=600", EVERY_STEP,
                        env_extra={"NAGMOE_HANG_TERM_GRACE_S": "3"})
    try:
        _stop_rank_1_after_step(procs, run_dir, 4)
        time.sleep(1.0)  # rank 0 is in its blocked collective now
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=120)
        waited = time.monotonic() - sent
    finally:
        stop_all(procs)
    log = read_log(tmp_path / "rank0.log")
    assert code == EXIT_HUNG and "SIGTERM" in log and "no step boundary since" in log, log[-3000:]
    assert 3 <= waited < 20, waited  # within Slurm's default KillWait (30 s)


@pytest.mark.distributed
def test_with_the_watchdog_off_a_silent_peer_ends_the_rank_at_the_collectives_training_timeout(dist_reference,
                                                                                                 tmp_path):
    """The collectives' own timeout after the first step (NAGMOE_DIST_TRAIN_TIMEOUT_S; the process group keeps
    NAGMOE_DIST_TIMEOUT_S, 30 min, for the rendezvous and the first step): a gloo collective past it raises, and
    the trainer makes that one line naming rank, host and step and the stack (exit status 1, torch's, as
    test_distributed_kill.py's timeout test has it)."""
    run_dir = str(tmp_path / "run")
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), "train.hang_timeout_s=0", EVERY_STEP,
                        env_extra={"NAGMOE_DIST_TRAIN_TIMEOUT_S": "3"})
    try:
        stopped_at, step = _stop_rank_1_after_step(procs, run_dir, 12)
        code = procs[0].wait(timeout=120)
        waited = time.monotonic() - stopped_at
    finally:
        stop_all(procs)
    log = read_log(tmp_path / "rank0.log")
    assert code == 1, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("[nagmoe] rank 0 on ")]
    assert len(lines) == 1 and "a collective timed out after step" in lines[0], lines
    print(f"[line] {lines[0]}")
    assert "; rank 1 on " in lines[0] and " silent since step " in lines[0], lines  # the culprit (issue 61)
    assert "Traceback" not in log and "File " in log  # the stack where it waited, not an error's traceback
    assert 3 <= waited < 3 + 40, waited  # the training timeout, plus a step in flight and the exit
