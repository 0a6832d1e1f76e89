"""Issue 27, checkpoints on milestones and saves that cannot be written: milestone checkpoints
(`train.keep_milestone_every_tokens`) survive pruning; a save that fails with an I/O error (DCP's
CheckpointException wrapping ENOSPC, or a plain OSError while publishing) or is refused for lack of disk space
keeps the previous checkpoints, leaves no partial directory and lets training continue with one warning line;
at the last step it stops the run with that line (exit 2) and the previous checkpoint intact."""
import errno
import json
import os

import pytest

from nagmoe.checkpoint.files import list_checkpoints
from nagmoe.base.errors import UserError
from nagmoe.train.trainer import Trainer


def steps_on_disk(run_dir):
    return [s for s, _ in list_checkpoints(run_dir)]


def leftovers(run_dir):
    root = os.path.join(run_dir, "checkpoints")
    return [n for n in os.listdir(root) if ".tmp-" in n or ".del-" in n]


def test_milestones_survive_pruning(micro_config, tmp_path):
    run_dir = str(tmp_path / "run")
    # 256 tokens per step: a milestone every 2 steps; the step interval alone would keep only the newest. Full
    # milestones (checkpoints marked so; weights-only ones live apart: tests/checkpoint/test_milestone.py)
    Trainer(micro_config("train.max_steps=7", "train.checkpoint_every=1", "train.keep_checkpoints=1",
                         "train.keep_milestone_every_tokens=512", "train.milestone_dtype=full"), run_dir,
            quiet=True).run()
    assert steps_on_disk(run_dir) == [2, 4, 6, 7]
    flags = {}
    for step, path in list_checkpoints(run_dir):
        with open(os.path.join(path, "state.json")) as f:
            flags[step] = json.load(f)["extra"].get("milestone", False)
    assert flags == {2: True, 4: True, 6: True, 7: False}
    plain = str(tmp_path / "plain")
    Trainer(micro_config("train.max_steps=3", "train.checkpoint_every=1", "train.keep_checkpoints=1"), plain,
            quiet=True).run()
    assert steps_on_disk(plain) == [3]


def enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_save_keeps_the_previous_checkpoint_and_training_goes_on(micro_config, tmp_path, monkeypatch,
                                                                          capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    from nagmoe.checkpoint import publish, torch_layout

    real_dcp, real_publish = torch_layout._dcp, torch_layout.publish
    failing = {"dcp": 4, "publish": 6}

    def dcp(fn, state, path):  # DCP reports a rank's I/O error to every rank wrapped like this
        if "step_000004" in path and fn.__name__ == "save" and failing["dcp"]:
            failing["dcp"] = 0
            raise CheckpointException("save failed", {0: (enospc(), None)})
        return real_dcp(fn, state, path)

    def publish_(tmp, final, *args, **kwargs):
        if final.endswith("step_000006") and failing["publish"]:
            failing["publish"] = 0
            raise enospc()
        return real_publish(tmp, final, *args, **kwargs)

    monkeypatch.setattr(torch_layout, "_dcp", dcp)
    monkeypatch.setattr(torch_layout, "publish", publish_)
    run_dir = str(tmp_path / "run")
    summary = Trainer(micro_config("train.max_steps=8", "train.checkpoint_every=2", "train.keep_checkpoints=3"),
                      run_dir, quiet=True).run()
    assert summary["steps"] == 8
    err = capsys.readouterr().err
    assert ("checkpoint at step 4 not written (OSError: No space left on device); newest checkpoint kept: "
            "step_000002; training continues") in err
    assert "checkpoint at step 6 not written (OSError: No space left on device)" in err
    assert steps_on_disk(run_dir) == [2, 8] and leftovers(run_dir) == []
    assert publish.is_milestone(list_checkpoints(run_dir)[0][1]) is False


def test_a_failed_last_save_stops_the_run_with_one_line(micro_config, tmp_path, monkeypatch):
    from nagmoe.checkpoint import torch_layout

    run_dir = str(tmp_path / "run")
    Trainer(micro_config("train.max_steps=2", "train.checkpoint_every=2"), run_dir, quiet=True).run()
    real = torch_layout.publish

    def publish_(tmp, final, *args, **kwargs):
        raise enospc()

    monkeypatch.setattr(torch_layout, "publish", publish_)
    with pytest.raises(UserError) as info:
        Trainer(micro_config("train.max_steps=3", "train.checkpoint_every=2"), run_dir, quiet=True).run()
    assert "checkpoint at step 3 not written" in str(info.value) and "step_000002" in str(info.value)
    monkeypatch.setattr(torch_layout, "publish", real)
    assert steps_on_disk(run_dir) == [2] and leftovers(run_dir) == []
    assert Trainer(micro_config("train.max_steps=3", "train.checkpoint_every=2"), run_dir,
                   quiet=True).progress.step == 2  # resumable from the kept checkpoint


def test_a_save_that_would_not_fit_is_skipped(micro_config, tmp_path, monkeypatch, capsys):
    import shutil

    from nagmoe.train import checkpoint_schedule

    real = shutil.disk_usage

    def tiny_disk(path):
        return real(path)._replace(free=1024)

    monkeypatch.setattr(checkpoint_schedule.shutil, "disk_usage", tiny_disk)
    run_dir = str(tmp_path / "run")
    with pytest.raises(UserError, match="checkpoint at step 4 not written .*GiB free"):
        Trainer(micro_config("train.max_steps=4", "train.checkpoint_every=2"), run_dir, quiet=True).run()
    assert steps_on_disk(run_dir) == [2]  # the first save had nothing to compare with; the last did not fit
