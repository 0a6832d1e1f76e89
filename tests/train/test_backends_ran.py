"""run_info.json names what actually ran (issue 38): after step 1 the expert path of every MoE layer (a fallback
with its reason) and the attention kernel (flash-attn, or SDPA and SDPA's kernel), and MoD's executed-query
kernel once MoD skips. Before, it listed only the backends configured at start, so a fallback stayed invisible."""
import json
import os

from nagmoe.train.trainer import Trainer


def _ran(micro_config, tmp_path, *overrides):
    run_dir = str(tmp_path / "run")
    Trainer(micro_config(*overrides), run_dir, quiet=True).run()
    return json.load(open(os.path.join(run_dir, "run_info.json")))["backends_ran"]


def test_run_info_names_the_kernels_that_ran(micro_config, tmp_path):
    ran = _ran(micro_config, tmp_path, "train.max_steps=3", "model.mod.skip_rate=0.25", "model.moe.impl=grouped")
    assert ran["experts"] == {"grouped": 2}  # 2 MoE layers, fp32 on CPU: _grouped_mm ran
    assert ran["attention"] == {"sdpa:flash_for_cpu": 2}  # CCA through SDPA, whose CPU flash kernel ran
    assert list(ran["attention_at_positions"]) and "fallbacks" not in ran  # MoD's executed queries (step 2 on)


def test_a_fallback_is_recorded_with_its_reason(micro_config, tmp_path):
    ran = _ran(micro_config, tmp_path, "train.max_steps=2", "model.moe.impl=grouped", "model.moe.expert_hidden=30",
               "model.attention.kind=mha", "model.attention.impl=math")
    (path,) = ran["experts"]
    assert path.startswith("loop (fallback: _grouped_mm cannot run float32 on cpu") and "H=30" in path
    assert ran["attention"] == {"math": 2}
    assert set(ran["fallbacks"]) == {"blocks.0.ffn.experts", "blocks.1.ffn.experts"}
