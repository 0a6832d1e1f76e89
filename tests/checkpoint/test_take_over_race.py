"""The take-over race (CI failure of 2026-12-05, docs/decisions.md): trainer 1 passed its fence and publishes a
save while trainer 2, which has just taken the lease over, resumes; both rename the same complete
`step_N.tmp-<tag>`. Whoever loses must not crash: trainer 2's resume rescans and takes the checkpoint as it then
stands; trainer 1's publish stops with the fence's one-line UserError naming the new holder. The other writer
is simulated inside the window (a wrapped function that runs there), on real checkpoints and real lease files."""
import json
import os
import threading
import time

import pytest
import torch

from nagmoe.base.errors import UserError
from nagmoe.base.files import write_atomic
from nagmoe.checkpoint import files, load_checkpoint, publish, resume, resume_checkpoint, save_checkpoint
from nagmoe.rundir.lease import RunDirLease
from nagmoe.rundir.names import LEASE_FILE


class Killed(BaseException):  # a death, not an error: no verdict is made of it (save_verdict.py)
    """A kill between a save's manifest and its rename."""


def model_of(value):
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def interrupted_save(run_dir, step, value, monkeypatch):
    """The complete `step_N.tmp-<tag>` a save leaves when it dies between its manifest and its rename (the
    project's own save path, stopped at publish's fsync of the finished tmp dir)."""
    real = publish.fsync_dir

    def die_once_complete(folder):
        real(folder)
        if publish.TMP_MARK in os.path.basename(folder):
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(publish, "fsync_dir", die_once_complete)
        with pytest.raises(Killed):
            save_checkpoint(str(run_dir), step, model_of(value))
    (tmp,) = [path for s, path in files.unfinished_writes(str(run_dir)) if s == step]
    assert files.is_valid_checkpoint(tmp)
    return tmp


def final_of(tmp):
    return tmp.split(publish.TMP_MARK)[0]


def weight_of(path):
    model = torch.nn.Linear(3, 3)
    load_checkpoint(path, model, restore_rng=False)
    return model.weight.detach()[0, 0].item()


@pytest.mark.parametrize("invalid_copy", [False, True], ids=["no-step-dir", "invalid-step-dir"])
def test_resume_takes_the_checkpoint_the_old_holder_published_under_it(invalid_copy, tmp_path, monkeypatch):
    """Right after resume validated the complete tmp dir, the old holder's publish renames it (removing an invalid
    step_N first, as publish does): resume must neither crash nor move that valid checkpoint away."""
    save_checkpoint(str(tmp_path), 1, model_of(1.0))
    tmp = interrupted_save(tmp_path, 2, 5.0, monkeypatch)
    final = final_of(tmp)
    if invalid_copy:
        os.makedirs(final)  # a step_N without a manifest: what an older, broken copy of the step looks like
    real = resume.is_valid_checkpoint
    published = []

    def old_holder_publishes_after_the_check(path):
        valid = real(path)
        if path == tmp and not published:
            if os.path.lexists(final):
                publish.remove_dir(final, "old-holder")
            os.rename(tmp, final)  # trainer 1's publish, between resume's check and its rename
            published.append(final)
        return valid

    monkeypatch.setattr(resume, "is_valid_checkpoint", old_holder_publishes_after_the_check)
    chosen = resume_checkpoint(str(tmp_path))
    assert published and chosen == final
    assert files.is_valid_checkpoint(final) and weight_of(final) == 5.0
    assert not files.unfinished_writes(str(tmp_path))


def test_resume_sees_a_checkpoint_published_while_it_scanned(tmp_path, monkeypatch):
    """The old holder's publish renames the tmp dir after resume listed it, before resume checks it: resume
    returns that newest checkpoint, not the older one its first scan found."""
    save_checkpoint(str(tmp_path), 1, model_of(1.0))
    tmp = interrupted_save(tmp_path, 2, 5.0, monkeypatch)
    real = resume.is_valid_checkpoint

    def old_holder_publishes_before_the_check(path):
        if path == tmp and os.path.isdir(tmp):
            os.rename(tmp, final_of(tmp))
        return real(path)

    monkeypatch.setattr(resume, "is_valid_checkpoint", old_holder_publishes_before_the_check)
    assert resume_checkpoint(str(tmp_path)) == final_of(tmp)
    assert weight_of(final_of(tmp)) == 5.0


def test_resume_survives_the_old_holder_publishing_while_it_hashes(tmp_path, monkeypatch):
    """The old holder's publish renames the tmp dir while resume is hashing its files: a file that vanishes
    mid-verification is a missing file (not an OSError out of resume), and resume takes the published step_N."""
    save_checkpoint(str(tmp_path), 1, model_of(1.0))
    tmp = interrupted_save(tmp_path, 2, 5.0, monkeypatch)
    real, lock, moved = files.sha256_and_sync, threading.Lock(), []

    def old_holder_publishes_mid_hash(path):
        with lock:
            if path.startswith(tmp + os.sep) and not moved:
                os.rename(tmp, final_of(tmp))
                moved.append(path)
        return real(path)

    monkeypatch.setattr(files, "sha256_and_sync", old_holder_publishes_mid_hash)
    assert resume_checkpoint(str(tmp_path)) == final_of(tmp)
    assert moved and weight_of(final_of(tmp)) == 5.0


def write_new_holders_lease(run_dir):
    """trainer 2's lease.json (another host, pid and token), written the way a lease is written."""
    now = time.time()
    write_atomic(os.path.join(run_dir, LEASE_FILE),
                 json.dumps({"host": "node-b", "pid": 4242, "slurm_job_id": None, "slurm_restart_count": 0,
                             "token": "theirs", "acquired": now, "refreshed": now}))


def test_a_publish_whose_save_the_new_holder_published_stops_naming_it(tmp_path, monkeypatch):
    """Trainer 1 passed its fence; just before its rename trainer 2 takes the lease over and its resume publishes
    trainer 1's complete tmp dir. Trainer 1 stops with the fence's own one-line UserError naming trainer 2."""
    run_dir = str(tmp_path / "run")
    lease = RunDirLease(run_dir).acquire()
    try:
        save_checkpoint(run_dir, 1, model_of(1.0), fence=lease.confirm)
        real = publish.fsync_dir
        taken = []

        def new_holder_takes_over(folder):
            real(folder)
            if publish.TMP_MARK in os.path.basename(folder) and not taken:
                write_new_holders_lease(run_dir)
                os.rename(folder, final_of(folder))  # trainer 2's recover_unfinished
                taken.append(folder)

        monkeypatch.setattr(publish, "fsync_dir", new_holder_takes_over)
        with pytest.raises(UserError) as raised:
            save_checkpoint(run_dir, 2, model_of(2.0), fence=lease.confirm)
        assert taken
        with pytest.raises(UserError) as fenced:
            lease.confirm()  # what the fence says from now on: the same line
        assert str(raised.value) == str(fenced.value)
        assert "taken over by 'node-b' pid 4242" in str(raised.value) and "\n" not in str(raised.value)
        step_2 = os.path.join(run_dir, "checkpoints", "step_000002")
        assert files.is_valid_checkpoint(step_2) and weight_of(step_2) == 2.0  # the new holder's to keep
    finally:
        lease.release()


def test_a_publish_whose_save_was_moved_by_someone_else_says_so(tmp_path, monkeypatch):
    """No other trainer holds the run dir, yet the save's directory vanished before its rename: a UserError
    saying so, not a traceback."""
    run_dir = str(tmp_path / "run")
    real = publish.fsync_dir

    def someone_moves_it(folder):
        real(folder)
        if publish.TMP_MARK in os.path.basename(folder):
            os.rename(folder, str(tmp_path / "moved"))

    monkeypatch.setattr(publish, "fsync_dir", someone_moves_it)
    with pytest.raises(UserError, match="moved by another process") as raised:
        save_checkpoint(run_dir, 1, model_of(1.0))
    assert "step_000001" in str(raised.value) and "\n" not in str(raised.value)
