"""SIGTERM / SIGUSR1 -> a checkpoint at the next step boundary and a clean exit with code 75
(EXIT_PREEMPTED; 0 under torchrun, nagmoe.train.preemption), in one process and in two gloo ranks, and the
restarted run reproduces the uninterrupted one bit for bit.

tests/slurm/test_preemption.py already covers SIGUSR1 to one process and the ranks' agreement on their own;
here: SIGTERM to one process, and SIGUSR1 to one of two training ranks, where both must save the same step
(one checkpoint with a shard from each rank) and both exit 75.
"""
import json
import os
import signal

import pytest

from nagmoe.checkpoint import MANIFEST, STATE, latest_valid_checkpoint
from nagmoe.train.preemption import EXIT_PREEMPTED, read_marker
from trainer_processes import (
    SHORT_STEPS,
    TIMING_KEYS,
    comparable,
    last_logged_step,
    logged_steps,
    nagmoe_train,
    read_log,
    records,
    run_trainer,
    start,
    start_ranks,
    stop_all,
    train_args,
    wait_all,
    wait_for,
)

NO_FINAL_EVAL = (*TIMING_KEYS, "val_bpb")  # a stopped run evaluates at its own last step


def assert_preempted_at(run_dir, reason):
    marker = read_marker(run_dir)
    assert marker is not None and marker["reason"] == reason, marker
    step = marker["step"]
    assert latest_valid_checkpoint(run_dir) == marker["checkpoint"] and marker["checkpoint"].endswith(f"{step:06d}")
    assert logged_steps(run_dir) == list(range(1, step + 1))  # stopped at a step boundary, nothing half-logged
    return step


def test_sigterm_checkpoints_at_the_next_step_and_exits_75(short_config, reference, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = start(nagmoe_train(*train_args(short_config, run_dir)), tmp_path / "stopped.log")
    try:
        wait_for(lambda: last_logged_step(run_dir) >= 4, 120, "step 4", [proc])
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        stop_all([proc])
    log = read_log(tmp_path / "stopped.log")
    assert proc.returncode == EXIT_PREEMPTED and "Traceback" not in log, log
    stopped = assert_preempted_at(run_dir, "SIGTERM")
    assert 4 <= stopped < SHORT_STEPS

    resumed = run_trainer(short_config, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert read_marker(run_dir) is None
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))
    assert comparable(records(run_dir), drop=NO_FINAL_EVAL) == \
        comparable(reference.records, upto=SHORT_STEPS, drop=NO_FINAL_EVAL)


@pytest.mark.distributed
def test_sigusr1_to_one_of_two_ranks_checkpoints_both_at_the_same_step(dist_reference, tmp_path):
    run_dir = str(tmp_path / "run")
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path))
    try:
        wait_for(lambda: last_logged_step(run_dir) >= 4, 180, "step 4 on two ranks", procs)
        procs[1].send_signal(signal.SIGUSR1)  # rank 1 only: rank 0 must stop with it
        codes = wait_all(procs, timeout=120)
    finally:
        stop_all(procs)
    logs = [read_log(tmp_path / f"rank{r}.log") for r in range(2)]
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], logs
    assert not any("Traceback" in log for log in logs), logs
    stopped = assert_preempted_at(run_dir, "another rank")  # the marker is rank 0's: it saw no signal itself
    assert 4 <= stopped < SHORT_STEPS
    # one collective save of that step: a tensor shard from each rank, the RNG state of each rank
    checkpoint = latest_valid_checkpoint(run_dir)
    with open(os.path.join(checkpoint, MANIFEST)) as f:
        shard_files = sorted(name for name in json.load(f)["files"] if name.endswith(".distcp"))
    # __<rank>_<n>.distcp: tensor files from both ranks (up to SAVE_FILES_PER_RANK each)
    assert sorted({name.split("_")[2] for name in shard_files}) == ["0", "1"], shard_files
    with open(os.path.join(checkpoint, STATE)) as f:
        state = json.load(f)
    assert state["step"] == stopped and len(state["rng"]) == 2

    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path))
    try:
        codes = wait_all(procs, timeout=240)
    finally:
        stop_all(procs)
    assert codes == [0, 0], [read_log(tmp_path / f"rank{r}.log") for r in range(2)]
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))
    assert comparable(records(run_dir), drop=NO_FINAL_EVAL) == comparable(dist_reference.records, drop=NO_FINAL_EVAL)
