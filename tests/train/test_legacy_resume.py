"""The migration rule for the keys of issues 22 and 23: a run dir whose saved config predates
`model.moe.gate_grad`, `model.mod.base_init_std`, `model.mod.threshold` and `model.mod.max_sublayer_skip`
resumes with their legacy values, bit-identically; a new run gets the new defaults."""
import os

import torch
import yaml

from nagmoe.config import LEGACY_VALUES
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.trainer import Trainer

OVERRIDES = ("model.moe.top_k=1", "model.mod.skip_rate=0.2", "train.max_steps=4", "train.checkpoint_every=2")
LEGACY = tuple(f"{k}={v}" for k, v in LEGACY_VALUES.items())


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


def strip_new_keys(run_dir):
    """What the config.yaml of a run started before issue 22 looks like."""
    path = os.path.join(run_dir, "config.yaml")
    with open(path) as f:
        data = yaml.safe_load(f)
    for key in LEGACY_VALUES:
        section, name = key.rsplit(".", 1)
        node = data
        for part in section.split("."):
            node = node[part]
        del node[name]
    with open(path, "w") as f:
        yaml.safe_dump(data, f)


def test_an_old_run_dir_resumes_with_the_legacy_behaviour_bit_identically(micro_config, tmp_path):
    torch.set_num_threads(1)
    straight = str(tmp_path / "straight")
    Trainer(micro_config(*OVERRIDES, *LEGACY), straight, quiet=True).run()

    old = str(tmp_path / "old")
    Trainer(micro_config(*OVERRIDES, *LEGACY, "train.max_steps=2"), old, quiet=True).run()
    strip_new_keys(old)
    Trainer(micro_config(*OVERRIDES), old, quiet=True).run()  # today's defaults on the command line
    assert losses(old) == losses(straight)
    with open(os.path.join(old, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert saved["model"]["moe"]["gate_grad"] == "none" and saved["model"]["mod"]["base_init_std"] == 0.02
    assert saved["model"]["mod"]["threshold"] == "per_sublayer" and saved["model"]["mod"]["max_sublayer_skip"] is None
    records = read_metrics(os.path.join(old, "metrics.jsonl"))
    assert any(r.get("mod_skipping") for r in records)  # the legacy thresholds did decide something

    new = str(tmp_path / "new")
    Trainer(micro_config(*OVERRIDES, "train.max_steps=2"), new, quiet=True).run()
    # the new defaults are another run (so the test can fail): the injection warm-up makes step 1 identical
    # (g = 0), and each parameter has its own init stream, so the runs part from step 2 on
    assert losses(new) != losses(straight)[:2]
