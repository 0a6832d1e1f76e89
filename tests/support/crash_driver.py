"""`nagmoe train` frozen at a chosen point inside one checkpoint save, so a test can kill -9 it exactly there.

    python crash_driver.py POINT STEP READY_FILE -- [nagmoe train arguments]

Runs the real CLI in this process, on either engine. While the save of checkpoint STEP is under way (its
`step_N.tmp-*` directory exists) and reaches POINT, the process writes its pid to READY_FILE and sleeps until
it is killed. Nothing else changes: the wrappers call the real functions, patched into the modules that look
them up at call time (nagmoe.checkpoint.publish, and the engine's save: nagmoe.checkpoint.torch_layout or
nagmoe.train.deepspeed_engine). Points, in the order a save passes them:

  tensors_written  the engine has written its tensor files; no state.json, no manifest, not published
  before_publish   the tmp dir is complete (manifest fsynced) but not yet renamed to step_N
  mid_replace      re-save over an invalid step_N only: that step_N was moved out of the step_* namespace,
                   the complete tmp dir is not yet renamed in
  before_prune     step_N is published; older checkpoints are not pruned yet
  mid_prune        an older checkpoint was renamed out of the step_* namespace but not yet deleted

A background save (`train.checkpoint_async=on`, issue 68) passes its own points; training goes on meanwhile except
at the first (the frozen thread is the save's):

  staging            the main thread is copying the state off the device (nothing written)
  background_write   the background thread has written this rank's tensor files (not hashed)
  digests            this rank has hashed its files (no state.json, no manifest, not published)
  before_publish     as above, in the background thread
"""
import glob
import os
import sys
import time

from nagmoe.checkpoint import publish as pub, torch_layout
from nagmoe.checkpoint.files import CHECKPOINTS, checkpoint_name

POINTS = ("tensors_written", "before_publish", "mid_replace", "before_prune", "mid_prune")
FIRST_SAVE_POINTS = tuple(p for p in POINTS if p != "mid_replace")  # a first save replaces nothing
# a re-save over an invalid step with keep_checkpoints=2 (checkpoints 10 and 20) prunes nothing
RESAVE_POINTS = tuple(p for p in POINTS if p != "mid_prune")
ASYNC_POINTS = ("staging", "background_write", "digests", "before_publish")


def _freeze(ready_file: str) -> None:
    with open(ready_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(ready_file + ".tmp", ready_file)
    while True:
        time.sleep(60)


def install(point: str, step: int, ready_file: str, run_dir: str) -> None:
    from nagmoe.train import deepspeed_engine

    name = checkpoint_name(step)

    def saving_target() -> bool:  # inside the save of checkpoint `step` (its tmp dir exists)
        return bool(glob.glob(os.path.join(run_dir, CHECKPOINTS, name + ".tmp-*")))

    real_rng = torch_layout.capture_rng_state
    real_fsync_dir, real_remove_replaced, real_prune, real_shutil = (pub.fsync_dir, pub.remove_replaced, pub.prune,
                                                                     pub.shutil)

    def capture_rng_state():  # both engines capture the RNG right after their tensor files are written
        if point == "tensors_written" and saving_target():
            _freeze(ready_file)
        return real_rng()

    def fsync_dir(path):
        real_fsync_dir(path)
        if point == "before_publish" and os.path.basename(path).startswith(name + ".tmp-"):
            _freeze(ready_file)

    def remove_replaced(final, tmp, tag):  # the publish's removal of the invalid step_N it replaces
        real_remove_replaced(final, tmp, tag)
        if point == "mid_replace" and os.path.basename(final) == name and saving_target():
            _freeze(ready_file)

    pruning = {"target": False}  # inside the prune that ends the save of checkpoint `step`

    def prune(root, run_dir_, new_step, keep, tag):
        if point == "before_prune" and new_step == step:
            _freeze(ready_file)
        pruning["target"] = new_step == step
        try:
            return real_prune(root, run_dir_, new_step, keep, tag)
        finally:
            pruning["target"] = False

    class Shutil:  # the module's `shutil`, with an rmtree that stops before deleting a renamed-out checkpoint
        def __getattr__(self, attr):
            return getattr(real_shutil, attr)

        @staticmethod
        def rmtree(path, *args, **kwargs):
            if point == "mid_prune" and ".del-" in os.path.basename(path) and pruning["target"]:
                _freeze(ready_file)
            return real_shutil.rmtree(path, *args, **kwargs)

    from torch.distributed.checkpoint.staging import DefaultStager

    from nagmoe.checkpoint import async_save

    real_stage, real_write, real_digests = DefaultStager.stage, async_save.BackgroundSave._write, async_save.own_digests

    def stage(self, state_dict, **kwargs):
        if point == "staging" and saving_target():
            _freeze(ready_file)
        return real_stage(self, state_dict, **kwargs)

    def write(self, staged, tmp):
        real_write(self, staged, tmp)
        if point == "background_write" and saving_target():
            _freeze(ready_file)

    def own_digests(root, rank):
        digests = real_digests(root, rank)
        if point == "digests" and saving_target():
            _freeze(ready_file)
        return digests

    DefaultStager.stage, async_save.BackgroundSave._write, async_save.own_digests = stage, write, own_digests
    torch_layout.capture_rng_state = deepspeed_engine.capture_rng_state = capture_rng_state
    pub.fsync_dir, pub.remove_replaced, pub.prune, pub.shutil = fsync_dir, remove_replaced, prune, Shutil()


def main(argv: list[str]) -> int:
    point, step, ready_file, sep, *train_args = argv
    if point not in POINTS + ASYNC_POINTS or sep != "--" or "--run-dir" not in train_args:
        raise SystemExit(f"usage: crash_driver.py {{{'|'.join(POINTS + ASYNC_POINTS)}}} STEP READY_FILE -- TRAIN_ARGS "
                         "(with --run-dir)")
    install(point, int(step), ready_file, train_args[train_args.index("--run-dir") + 1])
    from nagmoe.cli import main as nagmoe_main

    return nagmoe_main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
