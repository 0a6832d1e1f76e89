"""`nagmoe train` frozen at a chosen point inside one checkpoint save, so a test can kill -9 it exactly there.

    python crash_driver.py POINT STEP READY_FILE -- [nagmoe train arguments]

Runs the real CLI in this process. While the save of checkpoint STEP is under way and reaches POINT, the
process writes its pid to READY_FILE and sleeps until it is killed. Nothing else changes: the wrappers call
the real functions of nagmoe.checkpoint's torch_layout and publish modules (looked up by name at call time,
which is why patching those modules' attributes reaches them). Points, in the order a save passes them:

  tensors_written  DCP has written the tensor files; no state.json, no manifest, not published
  before_publish   the tmp dir is complete (manifest fsynced) but not yet renamed to step_N
  before_prune     step_N is published; older checkpoints are not pruned yet
  mid_prune        an older checkpoint was renamed out of the step_* namespace but not yet deleted
"""
import os
import sys
import time

from nagmoe.checkpoint import publish as pub, torch_layout as ckpt
from nagmoe.checkpoint.files import checkpoint_name

POINTS = ("tensors_written", "before_publish", "before_prune", "mid_prune")


def _freeze(ready_file: str) -> None:
    with open(ready_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(ready_file + ".tmp", ready_file)
    while True:
        time.sleep(60)


def install(point: str, step: int, ready_file: str) -> None:
    name = checkpoint_name(step)
    saving = {"target": False}  # inside the save of checkpoint `step`

    real_dcp, real_rng, real_fsync_dir = ckpt._dcp, ckpt.capture_rng_state, pub.fsync_dir
    real_prune, real_shutil = pub.prune, pub.shutil

    def dcp(fn, state, path):
        if fn is ckpt.dcp.save:
            saving["target"] = os.path.basename(path).startswith(name + ".tmp-")
        return real_dcp(fn, state, path)

    def capture_rng_state():
        if point == "tensors_written" and saving["target"]:
            _freeze(ready_file)
        return real_rng()

    def fsync_dir(path):
        real_fsync_dir(path)
        if point == "before_publish" and saving["target"] and ".tmp-" in os.path.basename(path):
            _freeze(ready_file)

    def prune(root, run_dir, new_step, keep, tag):
        if point == "before_prune" and new_step == step:
            _freeze(ready_file)
        return real_prune(root, run_dir, new_step, keep, tag)

    class Shutil:  # the module's `shutil`, with an rmtree that stops before deleting a renamed-out checkpoint
        def __getattr__(self, attr):
            return getattr(real_shutil, attr)

        @staticmethod
        def rmtree(path, *args, **kwargs):
            if point == "mid_prune" and saving["target"] and ".del-" in os.path.basename(path):
                _freeze(ready_file)
            return real_shutil.rmtree(path, *args, **kwargs)

    ckpt._dcp, ckpt.capture_rng_state = dcp, capture_rng_state
    pub.fsync_dir, pub.prune, pub.shutil = fsync_dir, prune, Shutil()


def main(argv: list[str]) -> int:
    point, step, ready_file, sep, *train_args = argv
    if point not in POINTS or sep != "--":
        raise SystemExit(f"usage: crash_driver.py {{{'|'.join(POINTS)}}} STEP READY_FILE -- TRAIN_ARGS")
    install(point, int(step), ready_file)
    from nagmoe.cli import main as nagmoe_main

    return nagmoe_main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
