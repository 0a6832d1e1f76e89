"""Issue 68, item 4: milestones as weights. With `train.milestone_dtype` bf16 a milestone is the model's weights
only (matrices, embedding and unembedding in bf16, the rest as trained; no optimizer state) under
RUN_DIR/milestones/: never pruned, never resumed from, and beside the full checkpoints without moving their
cadence or their minute clock; it reads back into the fp32 model as the checkpoint of its step cast by role. A run
dir from before the key keeps full milestones (checkpoints marked so), and those still read."""
import os
import shutil

import pytest
import torch
import yaml
from milestone_checks import assert_milestone_is_checkpoint_cast_by_role, stored_dtypes

from nagmoe.base.errors import UserError
from nagmoe.checkpoint import list_checkpoints, list_milestones, read_checkpoint_state, resume_checkpoint
from nagmoe.checkpoint.milestone import low_precision_keys
from nagmoe.checkpoint.publish import is_milestone
from nagmoe.model import build_model
from nagmoe.train.trainer import Trainer

SECONDS_PER_STEP = 45.0  # the fake clock: a full save every 2 steps at train.checkpoint_every_minutes=1


def test_weights_milestones_beside_the_full_checkpoints(micro_config, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    # 256 tokens a step: milestones at steps 3 and 6; full saves by the clock every 2 steps and at the last (7)
    cfg = micro_config("train.max_steps=7", "train.checkpoint_every_minutes=1", "train.sync_every=1",
                       "train.keep_checkpoints=2", "train.keep_milestone_every_tokens=768")
    assert cfg.train.milestone_dtype == "bf16"  # the default of a new run
    trainer = Trainer(cfg, run_dir)
    trainer.clock = lambda: SECONDS_PER_STEP * trainer.progress.step
    full_saves, checkpoint = [], trainer.checkpoint
    trainer.checkpoint = lambda *a, **k: full_saves.append(trainer.progress.step) or checkpoint(*a, **k)
    trainer.run()

    # the full cadence is the clock's alone: a milestone neither adds a full save nor restarts the clock
    assert full_saves == [2, 4, 6, 7]
    assert [s for s, _ in list_checkpoints(run_dir)] == [6, 7]  # pruned to keep_checkpoints
    assert not any(is_milestone(p) for _, p in list_checkpoints(run_dir))
    milestones = list_milestones(run_dir)
    root = os.path.join(run_dir, "milestones")
    assert milestones == [(3, os.path.join(root, "step_000003")), (6, os.path.join(root, "step_000006"))]
    assert sorted(os.listdir(root)) == ["step_000003", "step_000006"]  # never pruned, no leftovers

    path = milestones[1][1]
    state = read_checkpoint_state(path)
    assert state["format"] == "weights-1" and state["step"] == 6
    assert state["extra"]["milestone"] is True and state["extra"]["dtype"] == "bf16"
    assert state["extra"]["progress"]["tokens"] == 1536 and "loader" in state["extra"]
    dtypes = stored_dtypes(path)
    assert all(k.startswith("model.") for k in dtypes)  # the model only: no optimizer state
    low = {f"model.{k}" for k in low_precision_keys(build_model(cfg.model))}
    assert {"model.wte.weight", "model.lm_head.weight", "model.blocks.0.ffn.w_in"} <= low
    assert {k for k, d in dtypes.items() if d == torch.bfloat16} == low
    assert dtypes["model.stream.gates.0.weight"] == dtypes["model.blocks.0.ffn.router.weight"] == torch.float32

    assert_milestone_is_checkpoint_cast_by_role(cfg, path, os.path.join(run_dir, "checkpoints", "step_000006"))

    err = capsys.readouterr().err
    sizes = [line for line in err.splitlines() if "(weights, bf16)" in line]
    assert len(sizes) == 1 and "milestones/step_000003: " in sizes[0]  # the first one only
    # a milestone is never resumed from: without its checkpoints the run dir is refused, not resumed
    shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    with pytest.raises(UserError, match="none is valid"):
        resume_checkpoint(run_dir)


def test_a_run_dir_from_before_the_key_keeps_full_milestones_that_still_read(micro_config, tmp_path):
    from nagmoe.analysis.run_analysis import analyze_milestones

    run_dir = str(tmp_path / "run")
    base = ("train.keep_milestone_every_tokens=512", "train.checkpoint_every=1", "train.keep_checkpoints=1")
    Trainer(micro_config(*base, "train.max_steps=2", "train.milestone_dtype=full"), run_dir, quiet=True).run()
    path = os.path.join(run_dir, "config.yaml")
    with open(path) as f:
        saved = yaml.safe_load(f)
    del saved["train"]["milestone_dtype"]  # what a run dir from before issue 68 holds
    with open(path, "w") as f:
        yaml.safe_dump(saved, f)
    Trainer(micro_config(*base, "train.max_steps=5"), run_dir, quiet=True).run()  # today's default: bf16

    assert not os.path.exists(os.path.join(run_dir, "milestones"))
    assert [(s, is_milestone(p)) for s, p in list_checkpoints(run_dir)] == [(2, True), (4, True), (5, False)]
    assert "optim.state" in " ".join(stored_dtypes(list_checkpoints(run_dir)[0][1]))  # full checkpoints
    rows = analyze_milestones(run_dir, max_tokens=256)
    assert [(r["step"], r["milestone"]) for r in rows] == [(2, True), (4, True), (5, False)]
    assert len({r["val_loss"] for r in rows}) == 3


def test_a_failed_milestone_warns_and_is_tried_again_at_the_next_step(micro_config, tmp_path, monkeypatch, capsys):
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from nagmoe.checkpoint import milestone as milestone_module

    real, failing = milestone_module._dcp, [True]

    def dcp(fn, state, path):  # the disk full under the first milestone's DCP write, as DCP reports it
        if failing and fn.__name__ == "save":
            failing.clear()
            raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), None)})
        return real(fn, state, path)

    monkeypatch.setattr(milestone_module, "_dcp", dcp)
    run_dir = str(tmp_path / "run")
    Trainer(micro_config("train.max_steps=4", "train.keep_milestone_every_tokens=512"), run_dir, quiet=True).run()
    assert ("milestone at step 2 not written (OSError: No space left on device); training continues"
            in capsys.readouterr().err)
    assert [s for s, _ in list_milestones(run_dir)] == [3, 4]  # step 2's, one step late; then step 4's
    assert sorted(os.listdir(os.path.join(run_dir, "milestones"))) == ["step_000003", "step_000004"]


def test_milestones_of_an_abandoned_timeline_give_way(micro_config, tmp_path):
    """A run resumed from an earlier checkpoint continues another timeline: at its first milestone the milestones
    after that step (the old timeline's) go, as pruning removes such checkpoints."""
    run_dir = str(tmp_path / "run")
    base = ("train.checkpoint_every=1", "train.keep_checkpoints=5")
    Trainer(micro_config(*base, "train.max_steps=4", "train.keep_milestone_every_tokens=512"), run_dir,
            quiet=True).run()
    assert [s for s, _ in list_milestones(run_dir)] == [2, 4]
    for step in (3, 4):  # as if steps 3 and 4 had never been saved: the run resumes from step 2
        shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_00000{step}"))
    Trainer(micro_config(*base, "train.max_steps=3", "train.keep_milestone_every_tokens=256"), run_dir,
            quiet=True).run()
    assert [s for s, _ in list_milestones(run_dir)] == [2, 3]
    assert read_checkpoint_state(list_milestones(run_dir)[1][1])["extra"]["progress"]["tokens"] == 768
