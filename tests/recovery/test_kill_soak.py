"""Soak: the 120-step soak config killed (SIGKILL) three times at moments drawn from a fixed seed and
restarted each time ends exactly where the uninterrupted reference ends: every metrics record equal bit for
bit (but the timings), every step logged once, the same final model and optimizer state.

The moments: one kill before the first checkpoint (the restart begins from scratch and must drop the steps
already logged), one in each half of the rest; each a step to reach plus a sub-step delay, so kills land
anywhere in a step (forward, optimizer, metrics write, checkpoint save). Between the second kill and its
restart a torn last line is appended to metrics.jsonl, as a write cut by a crashed node or a full disk
leaves it (a SIGKILL cannot tear a line: each is written and flushed in one write call); the restart drops
it.
"""
import json
import os
import random
import time

import pytest

from nagmoe.config import load_config
from nagmoe.checkpoint import latest_valid_checkpoint
from trainer_processes import (
    assert_same_state,
    comparable,
    last_logged_step,
    loaded_state,
    logged_steps,
    metrics_path,
    nagmoe_train,
    read_log,
    records,
    run_trainer,
    start,
    stop_all,
    train_args,
    wait_for,
)

SEED = 15
STEPS = 120


def kill_moments(seed: int) -> list[tuple[int, float]]:
    """(step to reach, then seconds to wait) for each of the three kills."""
    rng = random.Random(seed)
    return [(rng.randint(lo, hi), round(rng.uniform(0.0, 0.05), 4)) for lo, hi in ((2, 9), (12, 60), (61, 112))]


@pytest.mark.slow
def test_three_seeded_kills_leave_the_run_bitwise_identical(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    moments = kill_moments(SEED)
    killed_at = []  # the last step logged before each kill
    for i, (step, delay) in enumerate(moments):
        # a metrics line every step (train.sync_every=1, which changes no number): the kills land at the drawn
        # steps, not only at the sync steps where the buffered lines are written
        args = train_args(reference.config, run_dir, "train.sync_every=1")
        if i and latest_valid_checkpoint(run_dir) is None:  # killed before the first checkpoint (issue 21)
            with open(metrics_path(run_dir), "rb") as f:
                history = f.read()
            refused = run_trainer(reference.config, run_dir)  # never starts over silently ...
            assert refused.returncode == 2 and "metrics.jsonl" in refused.stderr and "--start-over" in refused.stderr
            with open(metrics_path(run_dir), "rb") as f:
                assert f.read() == history  # ... and its metrics survive the refusal
            args.append("--start-over")  # what the operator then does
        proc = start(nagmoe_train(*args), tmp_path / f"life{i}.log")
        try:
            # a step after the last kill can only have been logged by this process
            target = max([step, *(k + 1 for k in killed_at)])
            wait_for(lambda: last_logged_step(run_dir) >= target, 180, f"step {target} (life {i})", [proc])
            time.sleep(delay)
            proc.kill()
            proc.wait(timeout=30)
        finally:
            stop_all([proc])
        assert proc.returncode == -9, read_log(tmp_path / f"life{i}.log")  # killed, not finished
        killed_at.append(last_logged_step(run_dir))
        if i == 1:
            with open(metrics_path(run_dir), "a") as f:
                f.write(json.dumps({"step": killed_at[-1] + 1, "loss": 1.0})[:17])  # no newline: torn
    assert killed_at[0] < 10 and latest_valid_checkpoint(run_dir) is not None, (moments, killed_at)

    final = run_trainer(reference.config, run_dir)
    assert final.returncode == 0, final.stderr
    assert logged_steps(run_dir) == list(range(1, STEPS + 1)), (moments, killed_at)
    assert comparable(records(run_dir)) == comparable(reference.records)
    with open(os.path.join(run_dir, "summary.json")) as f, \
            open(os.path.join(reference.run_dir, "summary.json")) as g:
        got, want = json.load(f), json.load(g)
    assert got["val_bpb"] == want["val_bpb"] and got["flops"] == want["flops"] and got["steps"] == STEPS

    cfg = load_config(reference.config)
    assert_same_state(loaded_state(latest_valid_checkpoint(run_dir), cfg),
                      loaded_state(latest_valid_checkpoint(reference.run_dir), cfg), "final checkpoint")
