"""The structure step (issue 54: modules moved between folders, e.g. checkpoint/run_dir.py -> rundir/info.py,
hf_export.py -> hf/export.py, the HF remote-code files into nagmoe/hf/remote/) must go unnoticed by its
users: a run dir, a checkpoint and a Hugging Face export made by the code of 37865e2 (the step's parent, taken
from this repository's history with `git archive` and run in its own processes) still resume, evaluate and
import under today's code (tests/train/old_code.py runs the old code, as for test_old_checkpoint.py)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from old_code import train_with_old_code, with_todays_config

OLD = "37865e2"  # the parent commit of the structure step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def old_run(request, tmp_path_factory):
    """{root, code, env, run_dir, args}: a micro run trained 2 steps (checkpoint at step 2) by 37865e2's code, which
    old_code.py checks is the code that ran (not this checkout's)."""
    home = tmp_path_factory.mktemp("hf_home")  # the old export's HF caches, never the user's; the hub offline
    return train_with_old_code(OLD, request, tmp_path_factory,
                               {"HF_HOME": str(home), "HF_MODULES_CACHE": str(home / "modules"),
                                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


@pytest.fixture(scope="module")
def old_export(old_run):
    """The Hugging Face export (fp32, checked without nagmoe) of the old run's step-2 checkpoint, by the old
    code's `python -m nagmoe export-hf`."""
    pytest.importorskip("transformers")  # the hf extra
    pytest.importorskip("safetensors")
    out = old_run["root"] / "export"
    done = subprocess.run([sys.executable, "-m", "nagmoe", "export-hf", "--run-dir", old_run["run_dir"], "--out",
                           str(out)], cwd=old_run["code"], env=old_run["env"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(out)


def _current_nagmoe(old_run):
    import nagmoe

    assert not nagmoe.__file__.startswith(str(old_run["code"])), nagmoe.__file__  # today's code in this process
    return nagmoe


def _copy_of(old_run, tmp_path) -> str:
    """The old run dir, copied byte for byte: the module's run dir stays as the old code left it for every test."""
    run_dir = str(tmp_path / "run")
    shutil.copytree(old_run["run_dir"], run_dir, symlinks=True)
    return run_dir


def test_the_parents_run_dir_resumes(old_run, tmp_path, nagmoe_cli):
    import torch

    _current_nagmoe(old_run)
    from nagmoe.checkpoint import latest_valid_checkpoint
    from nagmoe.rundir.info import read_saved_config, read_summary
    from nagmoe.rundir.metrics import read_metrics

    run_dir = _copy_of(old_run, tmp_path)
    assert latest_valid_checkpoint(run_dir).endswith("step_000002")
    cfg = read_saved_config(run_dir)
    assert cfg is not None and cfg.model.d_model == 32 and cfg.model.moe.n_experts == 4
    assert cfg.train.checkpoint_every == 2 and cfg.train.max_steps == 2
    nagmoe_cli("train", "--run-dir", run_dir, *with_todays_config(old_run["args"]), "train.max_steps=4")
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert torch.isfinite(torch.tensor([r["loss"] for r in records])).all()
    with open(os.path.join(run_dir, "run_info.json")) as f:
        assert json.load(f)["resumed_from"].endswith("step_000002")
    assert latest_valid_checkpoint(run_dir).endswith("step_000004")
    assert read_saved_config(run_dir).train.max_steps == 4
    summary = read_summary(run_dir)
    assert summary is not None and summary["steps"] == 4 and math.isfinite(summary["val_bpb"]), summary


def test_the_parents_checkpoint_evaluates(old_run, tmp_path, nagmoe_cli):
    _current_nagmoe(old_run)
    run_dir = old_run["run_dir"]
    nagmoe_cli("eval", "--run-dir", run_dir, "--offline-items", "8", "--out", tmp_path / "eval.json")
    with open(tmp_path / "eval.json") as f:
        evaluation = json.load(f)
    assert evaluation["checkpoint"].endswith("step_000002") and evaluation["tasks"]
    assert math.isfinite(evaluation["core_metric"]), evaluation
    assert all(math.isfinite(t["accuracy"]) for t in evaluation["tasks"]), evaluation["tasks"]


def test_the_parents_hf_export_imports(old_run, old_export, tmp_path, nagmoe_cli):
    import torch

    _current_nagmoe(old_run)
    from nagmoe.checkpoint import latest_valid_checkpoint
    from nagmoe.checkpoint.consolidate import load_consolidated

    imported = str(tmp_path / "imported")
    nagmoe_cli("import-hf", old_export, "--run-dir", imported)
    assert latest_valid_checkpoint(imported).endswith("step_000002")
    old_pt, new_pt = str(tmp_path / "old.pt"), str(tmp_path / "imported.pt")
    nagmoe_cli("consolidate", old_run["run_dir"], "--out", old_pt)
    nagmoe_cli("consolidate", imported, "--out", new_pt)
    _, old_state = load_consolidated(old_pt)
    _, new_state = load_consolidated(new_pt)
    assert sorted(new_state) == sorted(old_state) and "blocks.0.ffn.w_in" in old_state
    differ = [k for k in old_state if old_state[k].dtype != new_state[k].dtype
              or not torch.equal(old_state[k], new_state[k])]
    assert not differ, f"{len(differ)} tensors differ after import, e.g. {differ[:3]}"
