"""A rank that dies or hangs never leaves the others waiting: they exit (code 1) and a restart of all ranks
resumes exactly.

How a surviving rank learns of it (nagmoe.parallel.env.dist_timeout_s): a peer killed mid-run closes its
sockets, so the next collective fails at once on every other rank; a peer that hangs (here: SIGSTOP) or one
that dies before the rendezvous closes nothing, and the process-group timeout (NAGMOE_DIST_TIMEOUT_S,
default 30 min) ends the wait.
"""
import signal

import pytest

from nagmoe.base.errors import UserError
from nagmoe.parallel.env import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, dist_timeout_s
from nagmoe.checkpoint import latest_valid_checkpoint
from trainer_processes import (
    SHORT_STEPS,
    TIMING_KEYS,
    clean_env,
    comparable,
    free_port,
    last_logged_step,
    logged_steps,
    nagmoe_train,
    read_log,
    records,
    start,
    start_ranks,
    stop_all,
    train_args,
    wait_all,
    wait_for,
)

NO_FINAL_EVAL = (*TIMING_KEYS, "val_bpb")


@pytest.mark.distributed
def test_killing_rank_0_ends_rank_1_and_all_ranks_resume_exactly(dist_reference, tmp_path):
    run_dir = str(tmp_path / "run")
    # a timeout far above the wait allowed below: rank 1 must notice the closed connection, not time out
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), env_extra={TIMEOUT_ENV: "600"})
    try:
        wait_for(lambda: last_logged_step(run_dir) >= 12, 180, "step 12 on two ranks", procs)
        procs[0].kill()  # rank 0: it also hosts the rendezvous store and writes the metrics
        codes = wait_all(procs, timeout=60)
    finally:
        stop_all(procs)
    assert codes == [-9, 1], read_log(tmp_path / "rank1.log")[-3000:]  # None would be a hang
    resume_from = latest_valid_checkpoint(run_dir)
    assert resume_from is not None and int(resume_from[-6:]) >= 10

    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path))
    try:
        codes = wait_all(procs, timeout=240)
    finally:
        stop_all(procs)
    assert codes == [0, 0], [read_log(tmp_path / f"rank{r}.log")[-3000:] for r in range(2)]
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))
    assert comparable(records(run_dir), drop=NO_FINAL_EVAL) == comparable(dist_reference.records, drop=NO_FINAL_EVAL)


@pytest.mark.distributed
def test_a_hung_rank_ends_the_other_after_the_timeout(dist_reference, tmp_path):
    run_dir = str(tmp_path / "run")
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), env_extra={TIMEOUT_ENV: "8"})
    try:
        wait_for(lambda: last_logged_step(run_dir) >= 3, 180, "step 3 on two ranks", procs)
        procs[1].send_signal(signal.SIGSTOP)  # alive, sockets open, never answers
        codes = wait_all(procs[:1], timeout=90)
    finally:
        stop_all(procs)
    log = read_log(tmp_path / "rank0.log")
    assert codes == [1], log[-3000:]
    assert "Timed out" in log, log[-3000:]


@pytest.mark.distributed
def test_a_rank_whose_peer_never_starts_gives_up_after_the_timeout(short_config, tmp_path):
    # rank 1 of 2 alone: rank 0, which hosts the rendezvous store, died before it came up
    env = clean_env(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), **{TIMEOUT_ENV: "3"})
    proc = start(nagmoe_train(*train_args(short_config, str(tmp_path / "run"))), tmp_path / "rank1.log", env)
    try:
        (code,) = wait_all([proc], timeout=90)
    finally:
        stop_all([proc])
    log = read_log(tmp_path / "rank1.log")
    assert code == 1 and "timed out" in log, log[-3000:]


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf"])
def test_bad_timeout_values_are_user_errors(raw):
    with pytest.raises(UserError, match=f"{TIMEOUT_ENV}={raw!r}"):
        dist_timeout_s({TIMEOUT_ENV: raw})


def test_timeout_default_and_override():
    assert dist_timeout_s({}) == DEFAULT_TIMEOUT_S == 1800.0
    assert dist_timeout_s({TIMEOUT_ENV: "42.5"}) == 42.5
