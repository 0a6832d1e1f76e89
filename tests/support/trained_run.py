"""Fixtures of the bad-input, hostile-checkpoint, safe-loading and guard tests: a micro Trainer factory, and one small trained run whose folder
(config.yaml with a relative `data.data_dir: data`, data/, run/) can be copied whole and tampered with."""
import os
import shutil

import pytest

from cli_process import REPO, nagmoe_cli


@pytest.fixture
def make_trainer(micro_config, tmp_path):
    """A function building a Trainer on the micro config (quiet, fresh run dir) with extra overrides."""
    import torch

    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)

    def make(*overrides, run_dir=None):
        return Trainer(micro_config(*overrides), run_dir or str(tmp_path / "run"), quiet=True)

    return make


@pytest.fixture(scope="session")
def trained_run(request, micro_data, tmp_path_factory):
    """Folder with config.yaml (data.data_dir: data), data/ (a copy of the micro data) and run/ (2 steps,
    checkpoint at the end), trained through the CLI in that folder. Never modified: copy it first."""
    from nagmoe.config import dump_yaml, load_config

    root = tmp_path_factory.mktemp("trained_run")
    shutil.copytree(micro_data[0], root / "data")
    # MICRO_OVERRIDES from the root conftest's plugin (`from conftest import` gets whichever loaded last)
    root_conftest = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      [*root_conftest.MICRO_OVERRIDES, f"data.corpus={micro_data[1]}", "data.data_dir=data",
                       "train.max_steps=2", "train.schedule_steps=2", "train.warmup_steps=0",
                       "model.nag.warmup_tokens=0"])
    (root / "config.yaml").write_text(dump_yaml(cfg))
    done = nagmoe_cli("train", "--config", "config.yaml", "--run-dir", "run", "--quiet", cwd=root)
    assert done.returncode == 0, done.stderr
    return str(root)
