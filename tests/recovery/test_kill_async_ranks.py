"""Issue 68 on 2 ranks: kill -9 inside a background save (the DIST config: EP=2, a save every 10 steps, in the
background by default on 2 ranks), of the whole job or of one rank, at the window's points (crash_driver.py).

Whatever is killed, and wherever: step_10 stays published and valid; step_20 is either absent or complete (a tmp dir
whose manifest is written is published by the resume); a surviving rank exits at once (its peer's sockets closed),
not at a timeout; the restarted job resumes and equals the uninterrupted reference bit for bit."""
import json
import os
import sys

import pytest

from nagmoe.checkpoint import latest_valid_checkpoint
from nagmoe.parallel.env import TIMEOUT_ENV
from trainer_processes import (
    CRASH_DRIVER,
    SHORT_STEPS,
    TIMING_KEYS,
    checkpoint_steps,
    comparable,
    logged_steps,
    nagmoe_train,
    read_log,
    records,
    start_ranks,
    stop_all,
    wait_all,
    wait_for,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
KILLED_SAVE = 20
NO_FINAL_EVAL = (*TIMING_KEYS, "val_bpb")


# (point, the rank frozen there, who is killed, the step the restart resumes from): every point of the window, the
# whole job and the frozen rank alone; rank 0 for the publish (it alone publishes), rank 1 elsewhere
CASES = [
    ("staging", 1, "job", 10), ("staging", 1, "rank", 10),  # a rank copying its state off the device
    ("background_write", 1, "job", 10), ("background_write", 1, "rank", 10),  # its files written, unhashed
    ("digests", 1, "job", 10), ("digests", 1, "rank", 10),  # its files hashed; nothing published
    ("before_publish", 0, "job", 20), ("before_publish", 0, "rank", 20),  # complete, manifest written: the resume
]                                                                          # publishes it


@pytest.mark.parametrize("point,frozen,killed,resumes_from", CASES,
                         ids=[f"{p}-rank{r}-{k}" for p, r, k, _ in CASES])
def test_kill_9_inside_a_background_save_of_two_ranks(point, frozen, killed, resumes_from, dist_reference, tmp_path):
    run_dir = str(tmp_path / "run")
    ready = str(tmp_path / "frozen")

    def driver(rank):
        if rank != frozen:
            return nagmoe_train()
        return [sys.executable, CRASH_DRIVER, point, str(KILLED_SAVE), ready, "--"]

    # a process-group timeout far above the waits below: a survivor must notice the closed sockets
    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path), env_extra={TIMEOUT_ENV: "600"},
                        driver=driver)
    try:
        wait_for(lambda: os.path.exists(ready), 180, f"rank {frozen} to reach {point} in the save of step 20", procs)
        victims = procs if killed == "job" else [procs[frozen]]
        for p in victims:
            p.kill()
        codes = wait_all(procs, timeout=60)
    finally:
        stop_all(procs)
    logs = [read_log(tmp_path / f"rank{r}.log")[-3000:] for r in range(2)]
    if killed == "rank":  # the survivor ended at once with an error (None would be a hang)
        assert codes[frozen] == -9 and codes[1 - frozen] == 1, (codes, logs)
    on_disk = checkpoint_steps(run_dir)
    assert "step_000020" not in on_disk and "step_000010" in on_disk, on_disk  # never published unfinished
    assert latest_valid_checkpoint(run_dir).endswith("step_000010")

    procs = start_ranks(2, dist_reference.config, run_dir, str(tmp_path))
    try:
        codes = wait_all(procs, timeout=240)
    finally:
        stop_all(procs)
    assert codes == [0, 0], [read_log(tmp_path / f"rank{r}.log")[-3000:] for r in range(2)]
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"] == os.path.join(run_dir, "checkpoints", f"step_{resumes_from:06d}")
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))
    assert comparable(records(run_dir), drop=NO_FINAL_EVAL) == comparable(dist_reference.records, drop=NO_FINAL_EVAL)
