"""kill -9 inside a checkpoint write, and corrupt or partial checkpoints on disk.

A killed save never damages what was there before: until the rename that publishes it, a save lives in a tmp dir
that resume ignores (with a warning naming it) unless it is complete and newer than every valid checkpoint, when
resume publishes it; older checkpoints are pruned only after the new one is published; a valid step is never
saved again, and an invalid one is replaced so that a kill at any point of the replacement leaves a complete
copy (issue 21). A published checkpoint that fails its manifest (sha256 and size of every file, checked before
anything is loaded) is skipped with a warning naming it. Either way the resumed run reproduces the uninterrupted
reference bit for bit; and a run dir whose checkpoints are all invalid is not silently restarted from scratch."""
import json
import logging
import os
import shutil
import sys

import pytest
import torch

from crash_driver import ASYNC_POINTS, FIRST_SAVE_POINTS, RESAVE_POINTS
from nagmoe.base.errors import UserError
from nagmoe.checkpoint import MANIFEST, STATE, latest_valid_checkpoint, save_checkpoint
from trainer_processes import (
    CRASH_DRIVER,
    SHORT,
    SHORT_STEPS,
    TIMING_KEYS,
    checkpoint_steps,
    comparable,
    logged_steps,
    read_log,
    records,
    run_trainer,
    start,
    stop_all,
    train_args,
    wait_for,
)

KILLED_SAVE = 20  # the save the process is frozen in; the one before it is step 10
# the newest valid checkpoint on disk after a kill at each point of the step-20 save, and where the resume
# starts (a complete tmp dir newer than it is published by the resume)
VALID_ON_DISK = {"tensors_written": 10, "before_publish": 10, "mid_replace": 10, "before_prune": 20, "mid_prune": 20,
                 "staging": 10, "background_write": 10, "digests": 10}
RESUMES_FROM = {"tensors_written": 10, "before_publish": 20, "mid_replace": 20, "before_prune": 20, "mid_prune": 20,
                "staging": 10, "background_write": 10, "digests": 10}


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def tensor_file(checkpoint_dir: str) -> str:
    return next(os.path.join(checkpoint_dir, f) for f in sorted(os.listdir(checkpoint_dir)) if f.endswith(".distcp"))


@pytest.fixture(scope="module")
def crash_config(config_file):
    # keep_checkpoints=1: the harshest setting, where only one older checkpoint exists while a save runs
    return config_file("crash", *SHORT, "train.keep_checkpoints=1")


def kill_inside_save(point: str, config: str, run_dir: str, tmp_path, *more: str) -> None:
    """Train with the crash driver until the save of KILLED_SAVE reaches `point`, then SIGKILL."""
    ready = str(tmp_path / "frozen")
    argv = [sys.executable, CRASH_DRIVER, point, str(KILLED_SAVE), ready, "--", *train_args(config, run_dir, *more)]
    proc = start(argv, tmp_path / "crashed.log")
    try:
        wait_for(lambda: os.path.exists(ready), 120, f"the save of step {KILLED_SAVE} to reach {point}", [proc])
        proc.kill()  # SIGKILL, frozen inside the save
        proc.wait(timeout=30)
    finally:
        stop_all([proc])
    assert proc.returncode == -9, read_log(tmp_path / "crashed.log")


def resume_after_kill(point: str, config: str, run_dir: str, reference) -> None:
    """The restart after a kill at `point`: starts where it must, continues exactly, metrics intact."""
    on_disk = checkpoint_steps(run_dir)
    assert latest_valid_checkpoint(run_dir).endswith(f"step_{VALID_ON_DISK[point]:06d}"), on_disk
    if VALID_ON_DISK[point] == 10:  # the earlier checkpoint survived the killed save untouched
        assert "step_000010" in on_disk and any(name.startswith("step_000020.tmp-") for name in on_disk)

    resumed = run_trainer(config, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    unfinished = [os.path.join(run_dir, "checkpoints", name) for name in on_disk if ".tmp-" in name]
    if RESUMES_FROM[point] != VALID_ON_DISK[point]:
        assert f"recovered checkpoint {os.path.join(run_dir, 'checkpoints', 'step_000020')} from the complete " \
               f"save {unfinished[0]}" in resumed.stderr
    elif VALID_ON_DISK[point] == 10:
        assert f"skipping unfinished checkpoint {unfinished[0]}" in resumed.stderr
    with open(os.path.join(run_dir, "run_info.json")) as f:
        started_from = json.load(f)["resumed_from"]
    assert started_from == os.path.join(run_dir, "checkpoints", f"step_{RESUMES_FROM[point]:06d}")
    assert logged_steps(run_dir) == list(range(1, SHORT_STEPS + 1))  # each step once
    assert comparable(records(run_dir), drop=(*TIMING_KEYS, "val_bpb")) == \
        comparable(reference.records, upto=SHORT_STEPS, drop=(*TIMING_KEYS, "val_bpb"))


@pytest.mark.parametrize("point", FIRST_SAVE_POINTS)
def test_kill_9_inside_a_checkpoint_write_resumes_from_an_intact_checkpoint(point, crash_config, reference,
                                                                           tmp_path):
    run_dir = str(tmp_path / "run")
    kill_inside_save(point, crash_config, run_dir, tmp_path)
    resume_after_kill(point, crash_config, run_dir, reference)
    assert checkpoint_steps(run_dir) == [f"step_{SHORT_STEPS:06d}"]  # keep=1, leftovers of the kill removed


@pytest.mark.parametrize("point", ASYNC_POINTS)
def test_kill_9_inside_a_background_save_keeps_the_previous_checkpoint(point, crash_config, reference, tmp_path):
    """Issue 68: a kill at each point of a background save's window (training went on meanwhile, past the save)
    leaves step_10 published and valid, and no step_20 or a complete one (published by the resume); the resumed
    run equals the synchronous reference bit for bit."""
    run_dir = str(tmp_path / "run")
    kill_inside_save(point, crash_config, run_dir, tmp_path, "train.checkpoint_async=on")
    assert "step_000020" not in checkpoint_steps(run_dir)  # never published before its manifest
    resume_after_kill(point, crash_config, run_dir, reference)
    assert checkpoint_steps(run_dir) == [f"step_{SHORT_STEPS:06d}"]


@pytest.fixture(scope="module")
def resave_run(config_file, tmp_path_factory):
    """(config, run dir) trained to step 20 with checkpoints at 10 and 20, step_000020 then corrupted: the
    next run resumes from 10 and must save step 20 again over the invalid copy."""
    config = config_file("resave", *SHORT, "train.keep_checkpoints=2")
    run_dir = str(tmp_path_factory.mktemp("resave") / "run")
    done = run_trainer(config, run_dir, "train.max_steps=20")
    assert done.returncode == 0, done.stderr
    flip_byte(tensor_file(os.path.join(run_dir, "checkpoints", "step_000020")))
    return config, run_dir


@pytest.mark.parametrize("point", RESAVE_POINTS)
def test_kill_9_at_every_point_of_a_resave_leaves_a_checkpoint_to_continue_from(point, resave_run, reference,
                                                                              tmp_path):
    config, template = resave_run
    run_dir = str(tmp_path / "run")
    shutil.copytree(template, run_dir)
    kill_inside_save(point, config, run_dir, tmp_path)
    resume_after_kill(point, config, run_dir, reference)
    assert checkpoint_steps(run_dir) == ["step_000020", f"step_{SHORT_STEPS:06d}"]  # keep=2


def test_a_valid_step_is_never_saved_again(tmp_path):
    """A second save of a step that is on disk and verifies writes nothing and removes nothing: no window in
    which a kill could leave no copy (the preemption-right-after-a-checkpoint and resume cases)."""
    model = torch.nn.Linear(3, 3)
    first = save_checkpoint(str(tmp_path), 1, model)
    inode, files = os.stat(first).st_ino, sorted(os.listdir(first))
    with torch.no_grad():
        model.weight.add_(1.0)
    again = save_checkpoint(str(tmp_path), 1, model)
    assert again == first and os.stat(first).st_ino == inode and sorted(os.listdir(first)) == files
    assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["step_000001"]
    flip_byte(tensor_file(first))  # an invalid copy is replaced
    save_checkpoint(str(tmp_path), 1, model)
    assert latest_valid_checkpoint(str(tmp_path)) == first and os.stat(first).st_ino != inode


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning_and_resume_is_exact(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference.run_dir, run_dir)  # finished: checkpoints at steps 110 and 120
    bad = os.path.join(run_dir, "checkpoints", "step_000120")
    bad_file = tensor_file(bad)
    flip_byte(bad_file)  # same size, wrong sha256: only the manifest can tell
    resumed = run_trainer(reference.config, run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping invalid checkpoint {bad}" in resumed.stderr and os.path.basename(bad_file) in resumed.stderr
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"] == os.path.join(run_dir, "checkpoints", "step_000110")
    assert logged_steps(run_dir) == logged_steps(reference.run_dir)  # steps 111-120 again, once each
    assert comparable(records(run_dir)) == comparable(reference.records)


# ----------------------------------------------------------------------------------------------------------
# Each kind of damage is named in the warning (checkpoints of a plain module, no training)
# ----------------------------------------------------------------------------------------------------------
def flip_a_tensor_byte(checkpoint):
    flip_byte(tensor_file(checkpoint))
    return tensor_file(checkpoint)


def truncate_a_tensor_file(checkpoint):
    path = tensor_file(checkpoint)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    return path


def delete_state(checkpoint):
    os.remove(os.path.join(checkpoint, STATE))
    return os.path.join(checkpoint, STATE)


def delete_manifest(checkpoint):
    os.remove(os.path.join(checkpoint, MANIFEST))
    return MANIFEST


def tear_manifest(checkpoint):
    path = os.path.join(checkpoint, MANIFEST)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    return path


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "nagmoe.checkpoint" and r.levelno >= logging.WARNING]


# damage(checkpoint dir) -> the file the warning must name; and a word the warning must contain
DAMAGE = {
    "flipped byte": (flip_a_tensor_byte, "sha256"),
    "truncated file": (truncate_a_tensor_file, "bytes"),
    "missing file": (delete_state, "missing"),
    "no manifest": (delete_manifest, "incomplete"),
    "torn manifest": (tear_manifest, "unreadable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_each_damaged_checkpoint_is_named_in_a_warning(damage, tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
        save_checkpoint(str(tmp_path), step, model, optim, {"tokens": step})
    newest = os.path.join(tmp_path, "checkpoints", "step_000002")
    do_damage, text = DAMAGE[damage]
    named = do_damage(newest)
    with caplog.at_level(logging.WARNING, logger="nagmoe.checkpoint"):
        chosen = latest_valid_checkpoint(str(tmp_path))
    assert chosen.endswith("step_000001")
    (message,) = warnings_of(caplog)
    assert message.startswith(f"skipping invalid checkpoint {newest}: ") and named in message and text in message


def test_unfinished_save_is_named_in_a_warning(tmp_path, caplog):
    model = torch.nn.Linear(4, 4)
    done = save_checkpoint(str(tmp_path), 1, model)
    shutil.copytree(done, os.path.join(tmp_path, "checkpoints", "step_000002.tmp-4242"))
    shutil.copytree(done, os.path.join(tmp_path, "checkpoints", "step_000000.tmp-4243"))  # older: no warning
    with caplog.at_level(logging.WARNING, logger="nagmoe.checkpoint"):
        assert latest_valid_checkpoint(str(tmp_path)) == done
    assert warnings_of(caplog) == [
        f"skipping unfinished checkpoint {os.path.join(tmp_path, 'checkpoints', 'step_000002.tmp-4242')}: "
        "its save was interrupted"]


def test_a_run_whose_checkpoints_are_all_invalid_is_not_restarted_silently(micro_config, tmp_path):
    from nagmoe.train.trainer import Trainer

    run_dir = str(tmp_path / "run")
    Trainer(micro_config("train.max_steps=2"), run_dir, quiet=True).run()
    flip_byte(tensor_file(os.path.join(run_dir, "checkpoints", "step_000002")))
    metrics_before = records(run_dir)
    with pytest.raises(UserError, match=r"checkpoints.*none is valid.*--start-over"):
        Trainer(micro_config("train.max_steps=3"), run_dir, quiet=True)
    assert records(run_dir) == metrics_before  # nothing touched
    trainer = Trainer(micro_config("train.max_steps=3"), run_dir, quiet=True, start_over=True)  # start over
    assert trainer.progress.step == 0
    trainer.run()
    assert logged_steps(run_dir) == [1, 2, 3]
