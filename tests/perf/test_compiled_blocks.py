"""`train.compile` (issue 26): the sublayers of a block are the compiled unit, shared by every block, and steps
do not recompile (dynamo's counters, bf16 autocast on CPU); the setting's values and migration; the eager
layout's memory refusal on CUDA; the SDPA backend in the run's backends.

The graph counts use dynamo's `eager` backend: the guards (what recompiles, what shares a graph) are dynamo's
and do not depend on the backend; the trainer's step is checked against eager with `aot_eager` (autograd
traced as with inductor), both without inductor's cold compile (minutes on 2 cores; tests/perf/
test_compiled_step.py runs inductor)."""
from __future__ import annotations

import functools

import pytest
import torch

from nagmoe.train.memory import eager_memory_refusal
from nagmoe.train.speed import compile_model, resolve_compile, sdpa_backends

STEPS = 5
MOD = ("model.mod.skip_rate=0.2", "model.mod.start_tokens=0")  # skipping from step 2 (nag.warmup_tokens=256)
MHA = ("model.attention.kind=mha", "model.n_layers=4")  # CCA's depthwise convs cost seconds per CPU step
# variant: (overrides, sublayer classes, graphs expected); each count includes the loss's chunk, its own graph
# (issue 60, nagmoe/ops/loss.py)
VARIANTS = {
    "micro": ((), ("CCAttention", "MoELayer"), 3),  # the micro config itself: CCA + MoE, 2 blocks
    "mod": ((*MHA, *MOD), ("MultiHeadAttention", "MoELayer"), 4),
    "loop-experts": ((*MHA, "model.moe.impl=loop"), ("MultiHeadAttention", "MoELayer"), 4),
}


def _graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the compiled code of earlier tests ...
    counters.clear()  # ... and its counts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_blocks_share_their_graphs_and_steps_do_not_recompile(micro_config, variant):
    """The blocks run on one attention graph and one FFN graph, the loss on one more (MoD: one more, the FFN on the gathered
    executed tokens with their count symbolic; the loop expert backend: its host-read expert call runs
    eagerly between two graphs of the FFN). No graph or frame is added after step 2, although MoD's executed
    count changes every step; evaluation adds its own graphs once."""
    overrides, classes, expected = VARIANTS[variant]
    cfg = micro_config(*overrides)
    from nagmoe.model import build_model

    _fresh_dynamo()
    torch.manual_seed(0)
    model = build_model(cfg.model)
    summary = compile_model(model, backend="eager")
    assert summary["classes"] == list(classes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    seen, executed = [], []
    for step in range(STEPS):
        x = torch.randint(0, cfg.model.vocab_size, (4, cfg.data.seq_len), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, x)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        executed.append(model.mod_update())
        seen.append(_graphs())
    graphs, frames = seen[-1]
    print(f"\n{variant}: (unique graphs, frames) per step {seen}")
    assert seen[1:] == [seen[1]] * (STEPS - 1), f"recompiled after step 2: {seen}"
    assert graphs == expected < len(list(model.sublayers()))  # not one graph per block
    if variant == "mod":  # MoD really skipped, with a different count each step
        counts = {round(sum(f), 4) for f in executed[1:]}
        assert len(counts) == STEPS - 1 and max(min(f) for f in executed[1:]) < 1.0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x)
        after_first_eval = _graphs()
        model(x, x)
    assert _graphs() == after_first_eval


def _trainer_steps(cfg, run_dir, steps):
    from nagmoe.train.trainer import Trainer

    trainer = Trainer(cfg, str(run_dir), quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.release_lease()
    return trainer, losses, params


def test_compiled_trainer_step_equals_eager(micro_config, tmp_path, monkeypatch):
    """The Trainer with `train.compile=true` on the micro NAG MoE (with MHA; fp32 on CPU: the grouped experts
    run eagerly between graphs) and activation checkpointing around the compiled sublayers: the eager steps'
    losses and weights (the tolerance of tests/perf/test_compiled_step.py), the same parameter names."""
    import nagmoe.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "compile_model", functools.partial(compile_model, backend="aot_eager"))
    _fresh_dynamo()
    base = ("train.max_steps=2", "train.activation_checkpointing=true", "model.attention.kind=mha")
    _, ref_losses, ref_params = _trainer_steps(micro_config(*base), tmp_path / "eager", 2)
    trainer, losses, params = _trainer_steps(micro_config(*base, "train.compile=true"), tmp_path / "compiled", 2)
    assert trainer.backends["compile"].startswith("sublayers (MultiHeadAttention, MoELayer)")
    assert trainer.backends["sdpa"] == "math/cpu-flash"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-3, atol=2e-4)
    assert params.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=2e-3, atol=2e-4, msg=lambda m: f"{name}: {m}")


def test_compile_setting_values_and_migration(micro_config, tmp_path):
    from nagmoe.rundir.info import config_differences
    from nagmoe.config import LEGACY_VALUES, config_from_dict, load_config, to_dict

    assert micro_config().train.compile == "auto"  # the default of a new run: on for CUDA, off for CPU
    assert [resolve_compile("auto", d) for d in ("cuda", "cpu")] == [True, False]
    for value, expected in (("true", "true"), ("True", "true"), ("false", "false"), ("off", "false"), ("auto", "auto")):
        assert micro_config(f"train.compile={value}").train.compile == expected
    for flag in (True, False):  # a saved config's YAML boolean keeps its meaning
        (tmp_path / "c.yaml").write_text(f"train:\n  compile: {str(flag).lower()}\n")
        cfg = load_config(str(tmp_path / "c.yaml"))
        assert cfg.train.compile == str(flag).lower() and resolve_compile(cfg.train.compile, "cuda") is flag
    with pytest.raises(ValueError, match="train.compile"):
        micro_config("train.compile=sometimes")
    # a saved config without the key: the legacy value (eager), as before the key had a choice
    data = to_dict(micro_config())
    del data["train"]["compile"]
    assert LEGACY_VALUES["train.compile"] == "false"
    assert config_from_dict(data, legacy=True).train.compile == "false"
    # compile changes how a step runs, not what it computes: a run may resume with another setting
    assert config_differences(micro_config("train.compile=false"), micro_config()) == []


def test_eager_layout_that_cannot_fit_is_refused_naming_the_keys(micro_config):
    # without train.micro_batch_tokens the micro-batch is the rank's share of the batch (256 tokens / 2 ranks)
    message = eager_memory_refusal(micro_config("train.compile=false"), 2 ** 20, 1, 2)  # 1 MiB: nothing fits
    assert message is not None and "\n" not in message
    assert "train.compile" in message and "train.micro_batch_tokens=128" in message
    assert eager_memory_refusal(micro_config("train.compile=false", "train.micro_batch_tokens=64"), 2 ** 40, 1,
                                1) is None  # 1 TiB: fits
    for compiled in ("true", "auto"):  # compiled on CUDA: the eager estimate is only an upper bound
        assert eager_memory_refusal(micro_config(f"train.compile={compiled}"), 2 ** 20, 1, 1) is None


def test_sdpa_backend_label():
    assert sdpa_backends("cpu") == "math/cpu-flash"
    if torch.cuda.is_available():
        assert set(sdpa_backends("cuda").split("/")) <= {"flash", "efficient", "cudnn", "math"}


def test_compiled_sublayers_see_the_moving_expert_bias_without_recompiling(micro_config):
    """Issue 43: b is a buffer the compiled MoE graph reads as an input, not a constant it specialised on: the
    once-per-step in-place update (and a planted b that sends every token to expert 0) adds no graph or frame,
    and the compiled forward routes by the b of the moment."""
    from nagmoe.model import build_model
    from nagmoe.model.router_health import moe_layers

    cfg = micro_config(*MHA, "model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")
    _fresh_dynamo()
    torch.manual_seed(0)
    model = build_model(cfg.model)
    compile_model(model, backend="eager")
    layers = moe_layers(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(STEPS):
        x = torch.randint(0, cfg.model.vocab_size, (4, cfg.data.seq_len), generator=gen)
        out = model(x, x)
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad()
        model.update_expert_bias(torch.stack([layer.last_stats["tokens_per_expert"] for layer in layers]))
        seen.append(_graphs())
    assert seen[1:] == [seen[1]] * (STEPS - 1), f"recompiled as b moved: {seen}"
    assert float(layers[0].expert_bias.abs().max()) > 0
    with torch.no_grad():
        for layer in layers:
            layer.expert_bias[0] += 10.0  # beyond any probability gap: expert 0 is every token's first choice
    model(x, x)  # a training forward as above (no_grad would add its own graphs, as evaluation does)
    assert _graphs() == seen[-1]
    tokens = x.numel()
    for layer in layers:
        assert float(layer.last_stats["tokens_per_expert"][0]) == tokens
