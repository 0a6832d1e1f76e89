"""Which checkpoint a run resumes from (issue 21, points 2-4): a complete interrupted save is published, a
`.del-` copy never is, a run dir with history but no valid checkpoint is not started over without --start-over, and
each file is hashed once per load."""
import collections
import os
import shutil

import pytest
import torch

from nagmoe.checkpoint import files, latest_valid_checkpoint, load_checkpoint, resume_checkpoint, save_checkpoint
from nagmoe.base.errors import UserError


def saved(run_dir, step, value=0.0):
    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.fill_(value)
    return save_checkpoint(str(run_dir), step, model)


def corrupt(checkpoint):
    path = os.path.join(checkpoint, next(f for f in sorted(os.listdir(checkpoint)) if f.endswith(".distcp")))
    with open(path, "r+b") as f:
        f.seek(0)
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_complete_interrupted_save_is_published_on_resume(tmp_path):
    older = saved(tmp_path, 1)
    newer = saved(tmp_path / "elsewhere", 2, 5.0)
    tmp = os.path.join(tmp_path, "checkpoints", "step_000002.tmp-77")
    shutil.copytree(newer, tmp)  # what a kill between manifest and rename leaves
    assert latest_valid_checkpoint(str(tmp_path)) == older  # readers do not publish anything
    chosen = resume_checkpoint(str(tmp_path))
    assert chosen == os.path.join(tmp_path, "checkpoints", "step_000002") and not os.path.exists(tmp)
    model = torch.nn.Linear(3, 3)
    load_checkpoint(chosen, model, restore_rng=False)
    assert torch.all(model.weight == 5.0)


def test_an_incomplete_or_older_tmp_and_any_del_dir_are_never_published(tmp_path):
    saved(tmp_path, 3)
    root = os.path.join(tmp_path, "checkpoints")
    source = saved(tmp_path / "elsewhere", 4)
    shutil.copytree(source, os.path.join(root, "step_000002.tmp-1"))  # complete but older than step 3
    shutil.copytree(source, os.path.join(root, "step_000004.tmp-2"))
    os.remove(os.path.join(root, "step_000004.tmp-2", "manifest.json"))  # incomplete
    shutil.copytree(source, os.path.join(root, "step_000005.del-3"))  # being deleted: never comes back
    assert resume_checkpoint(str(tmp_path)) == os.path.join(root, "step_000003")
    assert sorted(os.listdir(root)) == ["step_000002.tmp-1", "step_000003", "step_000004.tmp-2", "step_000005.del-3"]


def test_a_recovered_save_replaces_an_invalid_copy_of_its_step(tmp_path):
    saved(tmp_path, 1)
    bad = saved(tmp_path, 2)
    corrupt(bad)
    good = saved(tmp_path / "elsewhere", 2, 7.0)
    shutil.copytree(good, os.path.join(tmp_path, "checkpoints", "step_000002.tmp-9"))
    assert resume_checkpoint(str(tmp_path)) == bad
    assert files.is_valid_checkpoint(bad)


@pytest.mark.parametrize("left", ["metrics.jsonl", "run_info.json", "summary.json", "checkpoints/step_000004.tmp-1",
                                  "checkpoints/step_000004.del-1", "checkpoints/step_000004"])
def test_history_without_a_valid_checkpoint_is_not_started_over(left, tmp_path):
    path = os.path.join(tmp_path, left)
    if "checkpoints" in left:
        os.makedirs(path)
    else:
        with open(path, "w") as f:
            f.write('{"step": 1}\n')
    with pytest.raises(UserError, match=f"{os.path.basename(left) if 'checkpoints' not in left else 'checkpoints/'}"
                                        ".*--start-over") as info:
        resume_checkpoint(str(tmp_path))
    assert "\n" not in str(info.value)
    assert resume_checkpoint(str(tmp_path), start_over=True) is None
    assert os.path.exists(path)  # refusing touches nothing


def test_a_fresh_or_config_only_run_dir_starts(tmp_path):
    assert resume_checkpoint(str(tmp_path / "new")) is None
    (tmp_path / "config.yaml").write_text("model: {}\n")
    assert resume_checkpoint(str(tmp_path)) is None


def test_each_file_is_hashed_once_per_resume_and_load(tmp_path, monkeypatch):
    saved(tmp_path, 1)
    newest = saved(tmp_path, 2)
    counts = collections.Counter()
    real = files.sha256_and_sync

    def counting(path):
        counts[path] += 1
        return real(path)

    monkeypatch.setattr(files, "sha256_and_sync", counting)
    chosen = resume_checkpoint(str(tmp_path))
    load_checkpoint(chosen, torch.nn.Linear(3, 3), restore_rng=False, verified=True)
    assert chosen == newest and counts and set(counts.values()) == {1}
    assert all(p.startswith(newest) for p in counts)  # the older checkpoint is not hashed at all
    counts.clear()
    load_checkpoint(chosen, torch.nn.Linear(3, 3), restore_rng=False)  # unverified: hashes once itself
    assert counts and set(counts.values()) == {1}
