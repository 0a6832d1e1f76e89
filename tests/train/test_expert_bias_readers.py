"""Every reader of a run dir reads the expert bias (issue 43 item 1): `nagmoe eval`, `generate`, `analyze` and
`consolidate` on a bias-on run; the model they load routes with the trained b (a model with b zeroed routes
otherwise), and the consolidated file carries b."""
import json

import torch

from nagmoe.model.router_health import expert_biases, moe_layers

BIAS = ("model.moe.expert_bias=true", "model.moe.bias_update_rate=0.05", "train.max_steps=3",
        "train.checkpoint_every=3")


def routing(model, idx):
    with torch.no_grad():
        model(idx)
    return [layer.last_stats["tokens_per_expert"].tolist() for layer in moe_layers(model)]


def test_eval_generate_analyze_and_consolidate_read_the_bias(micro_config, tmp_path, nagmoe_cli):
    from nagmoe.checkpoint.consolidate import load_consolidated, load_consolidated_model
    from nagmoe.eval.generate import load_run
    from nagmoe.train.trainer import Trainer

    run_dir = str(tmp_path / "run")
    trainer = Trainer(micro_config(*BIAS), run_dir, quiet=True)
    trainer.run()
    trained = expert_biases(trainer.model)
    assert float(trained.abs().max()) > 0

    loaded = load_run(run_dir).model  # what eval, generate and analyze load
    assert torch.equal(expert_biases(loaded), trained)
    idx = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with_b = routing(loaded, idx)
    with torch.no_grad():
        for layer in moe_layers(loaded):
            layer.expert_bias.zero_()
    assert routing(loaded, idx) != with_b  # b changes the routing here, so reading it matters

    nagmoe_cli("eval", "--run-dir", run_dir, "--offline-items", "8", "--out", tmp_path / "eval.json")
    assert nagmoe_cli("generate", "--run-dir", run_dir, "--prompt", "ROMEO:", "--max-new-tokens", "8")
    nagmoe_cli("analyze", "--run-dir", run_dir, "--out", tmp_path / "analysis.json", "--tokens", "512")
    with open(tmp_path / "analysis.json") as f:
        assert json.load(f)["router"]["load"]
    out = nagmoe_cli("consolidate", run_dir).strip()
    _, state = load_consolidated(out)
    assert torch.equal(torch.stack([state[f"blocks.{i}.ffn.expert_bias"] for i in range(2)]), trained)
    _, model = load_consolidated_model(out)
    assert torch.equal(expert_biases(model), trained) and routing(model, idx) == with_b
