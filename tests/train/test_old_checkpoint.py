"""Issue 43's migration check against real old code: a micro run trained by the code of c9620be (the commit the
issue was filed on, taken from this repository's history with `git archive`, run in its own process) still
resumes, evaluates and consolidates under today's code, with the expert bias off (its saved config predates
model.moe.expert_bias, whose legacy value is false) and its checkpoints' model keys unchanged."""
import json
import os

import pytest

from old_code import train_with_old_code, with_todays_config

OLD = "c9620be"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def old_run(request, tmp_path_factory):
    """(run dir, train arguments): 2 steps and a checkpoint written by c9620be's code."""
    run = train_with_old_code(OLD, request, tmp_path_factory)
    return run["run_dir"], run["args"]


def test_an_old_checkpoint_evaluates_consolidates_and_resumes(old_run, tmp_path, nagmoe_cli):
    import torch

    from nagmoe.checkpoint import latest_valid_checkpoint
    from nagmoe.checkpoint.consolidate import load_consolidated
    from nagmoe.rundir.info import read_saved_config
    from nagmoe.rundir.metrics import read_metrics

    run_dir, args = old_run
    assert latest_valid_checkpoint(run_dir).endswith("step_000002")
    cfg = read_saved_config(run_dir)
    assert cfg.model.moe.expert_bias is False and cfg.model.moe.lb_granularity == "micro_batch"
    nagmoe_cli("eval", "--run-dir", run_dir, "--offline-items", "8", "--out", tmp_path / "eval.json")
    with open(tmp_path / "eval.json") as f:
        evaluation = json.load(f)
    assert evaluation["checkpoint"].endswith("step_000002") and evaluation["tasks"]
    out = nagmoe_cli("consolidate", run_dir).strip()
    _, state = load_consolidated(out)
    assert not any("expert_bias" in k for k in state) and "blocks.0.ffn.w_in" in state
    # resume to step 4 with today's code and the old config file's arguments (today's config file)
    new_args = with_todays_config(args)
    nagmoe_cli("train", "--run-dir", run_dir, *new_args, "train.max_steps=4")
    steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"].endswith("step_000002")
    assert latest_valid_checkpoint(run_dir).endswith("step_000004")
    assert torch.isfinite(torch.tensor([r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
                                        if "loss" in r])).all()
