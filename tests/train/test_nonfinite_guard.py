"""Non-finite guard (issue 16, item 1): a NaN injected into one sublayer is caught before the optimizer
step, the message names that sublayer, halt stops with exit 3 and skip drops the update and counts it;
weights and optimizer state never change on a non-finite step."""
import copy
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nagmoe.train.guards import EXIT_NONFINITE, TrainingHalted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nan_output_hook(module, inputs, output):
    y, *rest = output  # (y, aux) or, for a MoE feeding NAG, (y, aux, gate_scale)
    return (y * float("nan"), *rest)


def snapshot(trainer):
    """Deep copies of the model and optimizer state (to compare bit for bit)."""
    return (copy.deepcopy(trainer.model.state_dict()),
            [copy.deepcopy(o.state_dict()) for o in trainer.optim])


def assert_same(before, after):
    (model_a, optim_a), (model_b, optim_b) = before, after
    for name, value in model_a.items():
        assert torch.equal(value, model_b[name]), f"{name} changed on a non-finite step"
    for a, b in zip(optim_a, optim_b):
        for pid, per_param in a["state"].items():
            for key, value in per_param.items():
                other = b["state"][pid][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (pid, key)


def test_halt_names_the_sublayer_and_touches_nothing(make_trainer):
    trainer = make_trainer("model.ffn=moe")
    trainer.train_step()  # optimizer state exists from here on
    before = snapshot(trainer)
    sub = list(trainer.model.sublayers())[3]  # block 1 ffn
    sub.register_forward_hook(nan_output_hook)
    with pytest.raises(TrainingHalted) as halted:
        trainer.train_step()
    assert halted.value.code == EXIT_NONFINITE == 3
    message = halted.value.message
    assert "\n" not in message
    assert "first non-finite output: sublayer 3: block 1 ffn (MoELayer)" in message, message
    assert "weights not updated" in message
    assert_same(before, snapshot(trainer))
    assert trainer.progress.step == 1


@pytest.mark.parametrize("poison, where", [
    (lambda m: m.blocks[0].attn.parameters().__next__().data.fill_(float("nan")),
     "first non-finite output: sublayer 0: block 0 attention"),
    (lambda m: m.stream.gates[1].alpha.data.fill_(float("inf")),
     "the residual update (NAG gate) after sublayer 1: block 0 ffn"),
])
def test_scan_names_a_poisoned_weight(make_trainer, poison, where):
    trainer = make_trainer()
    poison(trainer.model)
    with pytest.raises(TrainingHalted) as halted:
        trainer.train_step()
    assert where in halted.value.message, halted.value.message


def test_gradient_only_nan_names_the_parameter(make_trainer):
    trainer = make_trainer()
    trainer.model.lm_head.weight.register_hook(lambda g: g * float("nan"))  # finite forward, NaN backward
    with pytest.raises(TrainingHalted) as halted:
        trainer.train_step()
    message = halted.value.message
    assert "the forward is finite: first non-finite gradient in parameter lm_head.weight" in message, message


def test_skip_drops_the_update_counts_it_and_continues(make_trainer, tmp_path):
    trainer = make_trainer("train.nonfinite=skip", "train.max_steps=5", run_dir=str(tmp_path / "skip"))
    trainer.train_step()
    before = snapshot(trainer)
    handle = list(trainer.model.sublayers())[2].register_forward_hook(nan_output_hook)
    rec = trainer.train_step()
    handle.remove()
    assert rec["nonfinite_skipped"] == 1
    assert_same(before, snapshot(trainer))
    assert all(p.grad is None for p in trainer.model.parameters())  # no stale NaN gradient left behind
    rec = trainer.train_step()  # the next step trains normally
    assert rec["nonfinite_skipped"] == 1 and torch.isfinite(torch.tensor(rec["loss"]))
    changed = any(not torch.equal(v, trainer.model.state_dict()[k]) for k, v in before[0].items())
    assert changed
    assert trainer.progress.as_dict()["nonfinite_skipped"] == 1  # saved with the checkpoint's progress


def test_skip_counter_in_metrics_of_a_full_run(make_trainer, tmp_path):
    run_dir = str(tmp_path / "run")
    trainer = make_trainer("train.nonfinite=skip", "train.max_steps=4", run_dir=run_dir)
    calls = {"n": 0}

    def nan_on_step_2(module, inputs, output):  # one forward per step (no accumulation, no eval yet)
        calls["n"] += 1
        return nan_output_hook(module, inputs, output) if calls["n"] == 2 else output

    handle = list(trainer.model.sublayers())[1].register_forward_hook(nan_on_step_2)
    trainer.run()
    handle.remove()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["nonfinite_skipped"] for r in records] == [0, 1, 1, 1]
    assert records[1]["loss"] is None  # NaN is written as null
    assert all(r["loss"] is not None for r in records[2:])


DRIVER = """
import sys
import nagmoe.train.trainer as trainer_module
from nagmoe.cli import main

build = trainer_module.build_model

def build_poisoned(cfg):  # the injection: block 0 ffn outputs NaN
    model = build(cfg)
    list(model.sublayers())[1].register_forward_hook(lambda m, i, o: (o[0] * float("nan"), o[1]))
    return model

trainer_module.build_model = build_poisoned
sys.exit(main(sys.argv[1:]))
"""


def test_halt_through_the_cli_exits_3_with_one_line(trained_run, tmp_path):
    folder = str(tmp_path / "copy")
    shutil.copytree(trained_run, folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-c", DRIVER, "train", "--config", "config.yaml", "--run-dir",
                           "fresh_run", "--quiet"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("nagmoe train: error:")]
    assert len(lines) == 1 and "sublayer 1: block 0 ffn" in lines[0], done.stderr
    assert not os.path.isdir(os.path.join(folder, "fresh_run", "checkpoints"))  # nothing saved from it
