import os

import pytest

import hf_variants as variants


@pytest.fixture(autouse=True)
def _hf_home(tmp_path_factory, monkeypatch):
    """HF caches (remote-code modules included) under a temporary dir, never the user's; the hub offline."""
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_MODULES_CACHE", str(home / "modules"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


_MODELS = {}


@pytest.fixture(scope="session")
def native_of():
    """variant name -> (config, native model), built once per session."""
    def get(name):
        if name not in _MODELS:
            _MODELS[name] = variants.native_model(name)
        return _MODELS[name]
    return get


@pytest.fixture(scope="session")
def exported_run(tmp_path_factory, micro_config):
    """A micro NAG + MoE + MoD(20%) run trained 12 steps on the shared data, and its fp32 export (through the
    CLI, checked without nagmoe): (run_dir, export_dir)."""
    from nagmoe.cli import main
    from nagmoe.train.trainer import Trainer

    root = tmp_path_factory.mktemp("hf_run")
    run_dir, out = str(root / "run"), str(root / "export")
    cfg = micro_config("model.mod.skip_rate=0.2", "model.mod.start_tokens=0", "model.nag.warmup_tokens=0",
                       "train.max_steps=12", "train.schedule_steps=12")
    Trainer(cfg, run_dir, quiet=True).run()
    assert main(["export-hf", "--run-dir", run_dir, "--out", out]) == 0
    return run_dir, out

