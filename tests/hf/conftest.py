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
def exported_run(tmp_path_factory, micro_data, request):
    """A micro NAG + MoE + MoD(20%) run trained 12 steps on the shared data (a bf16 weights-only milestone at step
    6), and its fp32 export (through the CLI, checked without nagmoe): (run_dir, export_dir)."""
    from nagmoe.cli import main
    from nagmoe.train.trainer import Trainer

    root = tmp_path_factory.mktemp("hf_run")
    run_dir, out = str(root / "run"), str(root / "export")
    from nagmoe.config import load_config

    root_conftest = request.config.pluginmanager.get_plugin(os.path.join(variants.REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    cfg = load_config(os.path.join(variants.REPO, "configs", "tiny.yaml"), [
                       *root_conftest.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}",
                       "model.mod.skip_rate=0.2", "model.mod.start_tokens=0", "model.nag.warmup_tokens=0",
                       "train.max_steps=12", "train.schedule_steps=12", "train.keep_milestone_every_tokens=1536"])
    Trainer(cfg, run_dir, quiet=True).run()
    assert main(["export-hf", "--run-dir", run_dir, "--out", out]) == 0
    return run_dir, out

