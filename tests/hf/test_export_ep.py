"""A 2-rank expert-parallel run (EP=2, gloo) exports the same model as its consolidated checkpoint (issue 42,
"Round trip"): the export goes through nagmoe's one reader, which gathers the expert shards. The run has the
loss-free expert bias on (issue 43): after step 1 its b equals a single process's on the same global batch,
bitwise on every rank, and the export carries it."""
import os

import pytest
import torch
from safetensors.torch import load_file

from nagmoe.hf.export import PREFIX

from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.distributed


def _biases(trainer):
    from nagmoe.model.router_health import expert_biases

    return expert_biases(trainer.model).clone()


def _train(config_path, run_dir):
    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    trainer = Trainer(load_config(config_path), run_dir, quiet=True)
    trainer.train_step()
    after_step_1 = _biases(trainer).tolist()
    trainer.run()
    return {"step1": after_step_1, "end": _biases(trainer).tolist()}


def test_an_ep2_run_exports_its_consolidated_model(micro_data, request, tmp_path):
    from nagmoe.checkpoint.consolidate import consolidate_run, load_consolidated
    from nagmoe.cli import main
    from nagmoe.config import load_config
    from nagmoe.config.schema import dump_yaml

    root_conftest = request.config.pluginmanager.get_plugin(os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py"))
    data_dir, corpus = micro_data
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(repo, "configs", "tiny.yaml"), [
        *root_conftest.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}", "parallel.ep=2",
        "train.max_steps=3", "train.schedule_steps=3", "model.mod.skip_rate=0.2", "model.nag.warmup_tokens=0",
        "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_yaml(cfg))
    run_dir = str(tmp_path / "run")
    ranks = run_on_ranks(_train, 2, str(config_path), run_dir)
    assert ranks[0] == ranks[1]  # b bitwise equal on every rank, after step 1 and at the end
    from nagmoe.train.trainer import Trainer

    cfg.parallel.ep = 1
    single = Trainer(cfg, str(tmp_path / "single"), quiet=True)
    single.train_step()
    assert _biases(single).tolist() == ranks[0]["step1"]  # one process on the same global batch, step 1
    assert max(abs(v) for row in ranks[0]["step1"] for v in row) > 0
    out = str(tmp_path / "export")
    assert main(["export-hf", "--run-dir", run_dir, "--out", out]) == 0
    _, consolidated = load_consolidated(consolidate_run(run_dir))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert set(exported) == {PREFIX + k for k in consolidated}
    for key, t in consolidated.items():
        assert torch.equal(exported[PREFIX + key], t) and exported[PREFIX + key].dtype == t.dtype, key
    assert exported[PREFIX + "blocks.0.ffn.w_in"].shape[0] == cfg.model.moe.n_experts  # every expert, gathered
    assert exported[PREFIX + "blocks.0.ffn.expert_bias"].tolist() == ranks[0]["end"][0]
