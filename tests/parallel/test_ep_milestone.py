"""Issue 68, item 4 on 2 gloo ranks with expert parallelism (EP=2): the weights-only milestone stores each expert
once with its global offset (DTensor shards, as a checkpoint does), and one process reads every expert back: the
milestone equals the full checkpoint of the same step, bf16-rounded by role."""
import os

import pytest
from gloo_ranks import run_on_ranks
from milestone_checks import assert_milestone_is_checkpoint_cast_by_role, stored_dtypes

pytestmark = pytest.mark.distributed


def train(overrides, run_dir):
    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trainer = Trainer(load_config(os.path.join(repo, "configs/tiny.yaml"), overrides), run_dir, quiet=True)
    trainer.run()
    return trainer.mesh.ep


def test_an_ep_milestone_reads_back_every_expert_in_one_process(micro_overrides, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from nagmoe.checkpoint import read_checkpoint_state
    from nagmoe.config import load_config

    run_dir = str(tmp_path / "run")
    # 256 tokens a step: the milestone at step 2, the last step (a full checkpoint too)
    overrides = [*micro_overrides, "parallel.ep=2", "train.max_steps=2", "train.micro_batch_tokens=64",
                 "train.keep_milestone_every_tokens=512"]
    assert run_on_ranks(train, 2, overrides, run_dir, timeout=240) == [2, 2]
    milestone = os.path.join(run_dir, "milestones", "step_000002")
    state = read_checkpoint_state(milestone)
    assert state["layout"] == {"world_size": 2, "ep": 2} and state["extra"]["dtype"] == "bf16"
    meta = FileSystemReader(milestone).read_metadata().state_dict_metadata["model.blocks.0.ffn.w_in"]
    assert [c.offsets[0] for c in meta.chunks] == [0, 2]  # 4 experts: 2 a rank, each stored once at its offset
    assert all(k.startswith("model.") for k in stored_dtypes(milestone))
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    assert_milestone_is_checkpoint_cast_by_role(cfg, milestone, os.path.join(run_dir, "checkpoints", "step_000002"))
