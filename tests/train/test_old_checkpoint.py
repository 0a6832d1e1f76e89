"""Issue 43's migration check against real old code: a micro run trained by the code of c9620be (the commit the
issue was filed on, taken from this repository's history with `git archive`, run in its own process) still
resumes, evaluates and consolidates under today's code, with the expert bias off (its saved config predates
model.moe.expert_bias, whose legacy value is false) and its checkpoints' model keys unchanged."""
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OLD = "c9620be"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def old_run(request, tmp_path_factory):
    """(run dir, train arguments): 2 steps and a checkpoint written by c9620be's code."""
    if subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{OLD}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"{OLD} is not in this clone's history")  # a shallow clone; CI's full clone has it
    root = tmp_path_factory.mktemp("old_code")
    code = root / "code"
    archive = subprocess.run(["git", "-C", REPO, "archive", OLD, "nagmoe", "configs"], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(code, filter="data")
    data_dir, corpus = request.getfixturevalue("micro_data")
    micro = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py")).MICRO_OVERRIDES
    args = ["--config", str(code / "configs" / "tiny.yaml"), *micro, f"data.corpus={corpus}",
            f"data.data_dir={data_dir}", "train.checkpoint_every=2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import nagmoe; print(nagmoe.__file__)"], cwd=code, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(code)), where  # the old package, not this checkout's
    run_dir = root / "run"
    done = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--run-dir", str(run_dir), *args,
                           "train.max_steps=2"], cwd=code, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(run_dir), args


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
    new_args = [a if not a.endswith(os.path.join("configs", "tiny.yaml")) else os.path.join(REPO, "configs",
                                                                                              "tiny.yaml")
                for a in args]
    nagmoe_cli("train", "--run-dir", run_dir, *new_args, "train.max_steps=4")
    steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"].endswith("step_000002")
    assert latest_valid_checkpoint(run_dir).endswith("step_000004")
    assert torch.isfinite(torch.tensor([r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
                                        if "loss" in r])).all()
