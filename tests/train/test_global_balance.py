"""Global-batch balancing (issue 43 item 2): f from the step's running counts over every rank, P local; in one
process at accum 1 it is the micro-batch loss, at accum 4 micro-step m's f is the hand-computed running count."""
import tempfile

import pytest
import torch

from nagmoe.model import moe as moe_module
from nagmoe.model.router_health import moe_layers


def trainer_for(micro_config, *overrides):
    from nagmoe.train.trainer import Trainer

    torch.manual_seed(0)
    return Trainer(micro_config("model.mod.skip_rate=0", *overrides), tempfile.mkdtemp(), quiet=True)


def test_one_micro_batch_global_equals_micro_batch(micro_config):
    a = trainer_for(micro_config, "model.moe.lb_granularity=micro_batch", "train.micro_batch_tokens=256")
    b = trainer_for(micro_config, "model.moe.lb_granularity=global_batch", "train.micro_batch_tokens=256")
    ra, rb = a.train_step(), b.train_step()
    assert rb["aux_loss"] == pytest.approx(ra["aux_loss"], abs=1e-6) and rb["aux_loss"] > 0
    # bitwise by construction (measured on every ATEN_CPU_CAPABILITY): f is the same quotient of integer counts by
    # the N·K slots either way, so the backward runs the same kernels on the same values and AdamW (eps 1e-10) has no
    # rounding difference to amplify
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name


def test_the_running_count_over_four_micro_steps(micro_config, monkeypatch):
    t = trainer_for(micro_config, "model.moe.lb_granularity=global_batch", "train.micro_batch_tokens=64")
    assert t.accum == 4
    seen = []
    original = moe_module.GlobalBalance.loss

    def recording(self, layers, reduce_fn=None):
        counts = [layer.balance_inputs[1].double().clone() for layer in layers]
        tokens = [int(layer.last_stats["router_tokens"]) for layer in layers]  # this micro-step's routed tokens
        out = original(self, layers, reduce_fn)
        seen.append((counts, tokens, self.last_f_LE.clone()))
        return out
    monkeypatch.setattr(moe_module.GlobalBalance, "loss", recording)
    t.train_step()
    assert len(seen) == 4  # one per micro-step, none from anything else
    K = t.cfg.model.moe.top_k
    for m in range(4):
        for layer in range(len(moe_layers(t.model))):
            running = sum(seen[j][0][layer] for j in range(m + 1))
            tokens = sum(seen[j][1][layer] for j in range(m + 1))
            assert torch.allclose(seen[m][2][layer], running / (tokens * K), atol=0, rtol=0)
    assert not torch.equal(seen[0][2], seen[3][2])  # the count really runs


def test_the_layer_leaves_the_balance_term_to_the_step(micro_config):
    """global_batch: the model's own aux loss is the z-loss only (the trainer adds the LB term)."""
    t = trainer_for(micro_config, "model.moe.lb_granularity=global_batch")
    x, y = next(t.loader)
    out = t.model(x, y)
    z = sum(layer.z_loss_weight * layer.last_stats["z_loss"] for layer in moe_layers(t.model))
    assert torch.allclose(out.aux_loss, z, atol=1e-7, rtol=0)
