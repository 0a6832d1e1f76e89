"""kill -9 at every point of a DeepSpeed-engine save, first or repeated (issue 21, point 2): the restart
continues the uninterrupted run exactly, with metrics.jsonl intact. One process (DeepSpeed on one gloo rank,
AdamW); the same crash driver as the torch engine's tests (tests/support/crash_driver.py)."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from ds_ranks import requires_deepspeed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import crash_driver
from crash_driver import FIRST_SAVE_POINTS, RESAVE_POINTS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, KILLED = 6, 4  # checkpoints every 2 steps; the save of step 4 is the one killed
VALID_ON_DISK = {"tensors_written": 2, "before_publish": 2, "mid_replace": 2, "before_prune": 4, "mid_prune": 4}


def env_of(ds_env):
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                                             "SLURM_NTASKS")}
    return {**full, **ds_env, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


@pytest.fixture(scope="module")
def train_args(micro_overrides):
    def make(run_dir, *more):
        return ["--config", "configs/tiny.yaml", "--run-dir", run_dir, "--quiet", *micro_overrides,
                "train.eval_tokens=256", "parallel.engine=deepspeed", "train.optimizer=adamw",
                "train.checkpoint_every=2", f"train.max_steps={STEPS}", *more]
    return make


def nagmoe_train(args, ds_env, timeout=300):
    return subprocess.run([sys.executable, "-m", "nagmoe", "train", *args], cwd=REPO, env=env_of(ds_env),
                          capture_output=True, text=True, timeout=timeout)


def losses(run_dir):
    from nagmoe.rundir.metrics import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def reference(train_args, ds_env, tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_crash")
    straight = str(root / "straight")
    done = nagmoe_train(train_args(straight), ds_env)
    assert done.returncode == 0, done.stderr[-3000:]
    resave = str(root / "resave")  # checkpoints 2 and 4, then step 4 corrupted: the next run saves 4 again
    done = nagmoe_train(train_args(resave, "train.max_steps=4", "train.keep_checkpoints=2"), ds_env)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(resave, "checkpoints", "step_000004", "state.json"), "a") as f:
        f.write(" ")
    return losses(straight), resave


def kill_and_resume(point, args, ds_env, run_dir, tmp_path, want):
    from nagmoe.checkpoint import latest_valid_checkpoint

    ready = str(tmp_path / "frozen")
    driver = crash_driver.__file__
    proc = subprocess.Popen([sys.executable, driver, point, str(KILLED), ready, "--", *args], cwd=REPO,
                            env=env_of(ds_env), stdout=subprocess.DEVNULL, stderr=open(tmp_path / "crash.log", "w"))
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(ready):
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "crash.log").read()[-3000:]
            time.sleep(0.2)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert latest_valid_checkpoint(run_dir).endswith(f"step_{VALID_ON_DISK[point]:06d}")
    resumed = nagmoe_train(args, ds_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run_dir) == want  # each step once, bitwise the uninterrupted run's


def in_ci(points, kept):
    """The kill points CI runs; the others are `make test-scale` (CI time, issue 50 item 4). Publishing and
    pruning are the engine-independent code every point of tests/recovery/test_kill_during_checkpoint.py
    kills in CI; what is DeepSpeed's own is its files half written (tensors_written) and a resave replacing a
    published checkpoint (mid_replace)."""
    return [p if p in kept else pytest.param(p, marks=pytest.mark.scale) for p in points]


@requires_deepspeed
@pytest.mark.parametrize("point", in_ci(FIRST_SAVE_POINTS, ("tensors_written",)))
def test_kill_at_every_point_of_a_first_deepspeed_save(point, train_args, reference, ds_env, tmp_path):
    run_dir = str(tmp_path / "run")
    kill_and_resume(point, train_args(run_dir, "train.keep_checkpoints=1"), ds_env, run_dir, tmp_path, reference[0])


@requires_deepspeed
@pytest.mark.parametrize("point", in_ci(RESAVE_POINTS, ("tensors_written", "mid_replace")))
def test_kill_at_every_point_of_a_deepspeed_resave(point, train_args, reference, ds_env, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference[1], run_dir)
    kill_and_resume(point, train_args(run_dir, "train.keep_checkpoints=2"), ds_env, run_dir, tmp_path, reference[0])
