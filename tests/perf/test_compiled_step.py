"""`train.compile` and `train.activation_checkpointing` change speed and memory, not the numbers: a few
training steps of the micro config (NAG MoE) match the plain eager steps."""
from __future__ import annotations

import pytest
import torch

from nagmoe.train.trainer import Trainer


def _run_steps(cfg, run_dir, steps: int):
    trainer = Trainer(cfg, str(run_dir), quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return trainer, losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _assert_same(ref, other, rtol, atol):
    _, ref_losses, ref_params = ref
    _, losses, params = other
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    assert params.keys() == ref_params.keys()  # no renamed parameter: checkpoints stay compatible
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def eager_reference(micro_config, tmp_path):
    return _run_steps(micro_config("train.max_steps=3"), tmp_path / "eager", 3)


def test_activation_checkpointing_step_equals_eager(micro_config, tmp_path, eager_reference):
    cfg = micro_config("train.max_steps=3", "train.activation_checkpointing=true")
    result = _run_steps(cfg, tmp_path / "ckpt", 3)
    assert all(getattr(s, "_checkpointed", False) for s in result[0].model.sublayers())
    # bitwise by construction (the recompute runs the same kernels on the same inputs, in the same order; measured
    # equal on every ATEN_CPU_CAPABILITY), so AdamW has no rounding difference to amplify
    _assert_same(eager_reference, result, rtol=1e-5, atol=1e-6)


def test_compiled_step_with_fused_nag_equals_eager(micro_config, tmp_path):
    """One dense MHA block, so the cold compile stays short (this shape of model compiles to a single graph; the
    MoE dispatch would add graph breaks, see nagmoe/train/speed.py)."""
    small = ("train.max_steps=2", "model.ffn=dense", "model.n_layers=1", "model.attention.kind=mha")
    eager_reference = _run_steps(micro_config(*small), tmp_path / "eager", 2)
    cfg = micro_config(*small, "train.compile=true", "model.nag.impl=compiled")
    result = _run_steps(cfg, tmp_path / "compiled", 2)
    assert result[0].backends["NAGResidual.impl"] == "compiled"
    # Muon's Newton-Schulz amplifies last-bit differences of fused kernels over steps: a loose tolerance
    _assert_same(eager_reference, result, rtol=2e-3, atol=2e-4)


def test_activation_checkpointing_under_mod_skipping_matches_plain_gradients():
    """MoD calls sublayers on the gathered executed tokens (`select=`): the checkpointed recompute must see the
    same selection, so gradients equal the plain model's."""
    from nagmoe.config import AttentionConfig, ModelConfig, MoDConfig, MoEConfig, NAGConfig
    from nagmoe.model import build_model
    from nagmoe.train.speed import enable_activation_checkpointing

    cfg = ModelConfig(residual="nag", vocab_size=128, d_model=32, n_layers=2, max_seq_len=64, ffn="moe",
                      attention=AttentionConfig(n_heads=2), moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32),
                      nag=NAGConfig(C=4), mod=MoDConfig(skip_rate=0.2))
    gen = torch.Generator().manual_seed(0)
    idx, calib = torch.randint(0, 128, (2, 64), generator=gen), torch.randint(0, 128, (2, 64), generator=gen)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        with torch.no_grad():
            model(calib)
        model.mod_update()
        model.set_mod_skip_rate(0.2)
        if checkpointed:
            assert enable_activation_checkpointing(model) == 4
        out = model(idx, idx, collect_stats=True)
        assert min(out.stats["executed_frac"]) < 1.0  # tokens really were skipped
        (out.loss + out.aux_loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
