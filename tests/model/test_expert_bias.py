"""The loss-free expert bias (issue 43 item 1), the layer and its controller: selection only, no gradient, the
update rule in place, and the controller's behaviour on fixed probabilities."""
import math

import pytest
import torch

from nagmoe.config import MoEConfig
from nagmoe.model.moe import MoELayer

D, E, K = 16, 8, 2


def layer(bias=True, rate=1e-2, seed=0):
    torch.manual_seed(seed)
    m = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=12, impl="loop", expert_bias=bias,
                              bias_update_rate=rate))
    with torch.no_grad():
        m.w_out.normal_(0, 0.3)
    return m


def test_the_buffer_exists_only_when_on_and_starts_at_zero():
    assert "expert_bias" not in layer(bias=False).state_dict() and layer(bias=False).expert_bias is None
    b = layer().state_dict()["expert_bias"]
    assert b.dtype == torch.float32 and b.shape == (E,) and torch.equal(b, torch.zeros(E))


def test_selection_only_logits_probabilities_and_losses_unchanged():
    x = torch.randn(3, 10, D)
    plain, biased = layer(), layer()
    with torch.no_grad():
        biased.expert_bias.copy_(torch.randn(E) * 0.2)
    seen = {}
    for name, m in (("plain", plain), ("biased", biased)):
        m.router.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, out))
        m(x)
    assert torch.equal(seen["plain"], seen["biased"])  # logits (hence probabilities and the z-loss) bitwise
    assert torch.equal(plain.last_stats["z_loss"], biased.last_stats["z_loss"])
    assert float(biased.last_stats["rerouted_slots"]) > 0  # the bias really moved choices
    assert not torch.equal(plain.last_stats["tokens_per_expert"], biased.last_stats["tokens_per_expert"])
    # the balance loss's P is the mean unbiased probability: LB = E·Σ f·P with the layer's own f
    probs = seen["biased"].softmax(-1)
    f = biased.last_stats["tokens_per_expert"].float() / (30 * K)
    assert torch.allclose(biased.last_stats["lb_loss"], E * (f * probs.mean(0)).sum(), rtol=0, atol=1e-7)


def test_gates_are_unbiased_probabilities_of_the_biased_choice_and_b_gets_no_gradient():
    m = layer()
    with torch.no_grad():
        m.expert_bias.copy_(torch.randn(E) * 0.2)
    x = torch.randn(2, 6, D, requires_grad=True)
    y, _ = m(x)
    # the hand reference: choose by probs + b, weight by probs, ReLU² experts
    x_ND = x.reshape(-1, D)
    probs = torch.softmax(x_ND.detach() @ m.router.weight.detach().T, -1).requires_grad_(False)
    logits = x_ND @ m.router.weight.T
    p = logits.softmax(-1)
    chosen = (p.detach() + m.expert_bias).topk(K, -1).indices
    ref = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for k in range(K):
            e = int(chosen[n, k])
            ref[n] = ref[n] + p[n, e] * (torch.relu(x_ND[n] @ m.w_in[e]) ** 2 @ m.w_out[e])
    assert torch.allclose(y.reshape(-1, D), ref, atol=1e-5)
    assert not torch.equal(chosen, probs.topk(K, -1).indices)  # some choice differs from the unbiased one
    g_layer = torch.autograd.grad(y.square().sum(), m.router.weight, retain_graph=True)[0]
    g_ref = torch.autograd.grad(ref.square().sum(), m.router.weight)[0]
    assert torch.allclose(g_layer, g_ref, atol=1e-5)
    assert not m.expert_bias.requires_grad and m.expert_bias.grad is None


def test_the_update_is_in_place_sign_based_and_recentred():
    m = layer(rate=0.01)
    b = m.expert_bias
    ptr = b.data_ptr()
    counts = torch.tensor([10, 0, 3, 3, 3, 3, 2, 8], dtype=torch.float64)
    m.update_expert_bias(counts)
    step = 0.01 * torch.sign(counts.mean() - counts).float()
    assert torch.allclose(b, step - step.mean(), atol=0) and b.data_ptr() == ptr
    assert m.state_dict()["expert_bias"].data_ptr() == ptr  # what a checkpoint saves is what moved
    assert abs(float(b.mean())) < 1e-8
    frozen = layer(rate=0.0)
    frozen.expert_bias.fill_(0.3)
    frozen.update_expert_bias(counts)
    assert torch.equal(frozen.expert_bias, torch.full((E,), 0.3))  # rate 0: frozen, still applied


def controller_run(gamma, probs_NE, updates):
    """The bias controller on fixed probabilities: counts from topk(probs + b), one update each."""
    m = layer(rate=gamma)
    history = []
    for _ in range(updates):
        chosen = (probs_NE + m.expert_bias).topk(K, -1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=E).double()
        history.append((counts.max() / counts.mean()).item() if counts.mean() > 0 else float("inf"))
        history[-1] = (history[-1], int((counts == 0).sum()), m.expert_bias.clone())
        m.update_expert_bias(counts)
    return history


@pytest.mark.parametrize("gamma", [1e-3, 1e-2])
def test_the_controller_balances_fixed_probabilities(gamma):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(512, E, generator=g) * 0.5
    logits[:, 0] += 2.0  # collapsed onto expert 0 (and whichever is second) at the start
    probs = logits.softmax(-1)
    top = probs.topk(K + 1, -1).values
    gap = float((probs.max(-1).values - probs.min(-1).values).max())  # the largest move any token needs
    n = math.ceil(gap / gamma) + 20
    history = controller_run(gamma, probs, n + 60)
    first = history[0]
    assert first[0] > 2.0  # collapsed before
    ratio, dead, b_n = history[n]
    assert ratio <= 1.25 and dead == 0, (ratio, dead)
    assert all((h[2] - b_n).abs().max() <= 2 * gamma + 1e-7 for h in history[n:])  # settled within 2γ
    assert top.shape == (512, K + 1)


def test_gamma_zero_stays_collapsed():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(512, E, generator=g) * 0.5
    logits[:, 0] += 2.0
    history = controller_run(0.0, logits.softmax(-1), 50)
    assert all(h[0] > 2.0 for h in history)


def test_the_bias_needs_a_moe_ffn_and_a_finite_rate(tmp_path):
    from nagmoe.config import load_config
    from nagmoe.base.errors import UserError

    for bad, needle in ((["model.ffn=dense", "model.moe.expert_bias=true"], "model.moe.expert_bias"),
                        (["model.moe.bias_update_rate=-1"], "bias_update_rate"),
                        (["model.moe.bias_update_rate=.inf"], "bias_update_rate")):
        with pytest.raises(UserError, match=needle):
            load_config(None, bad)


def test_a_saved_config_without_the_keys_reads_the_bias_off():
    from nagmoe.config import config_from_dict

    cfg = config_from_dict({"model": {"ffn": "moe"}}, legacy=True)
    assert cfg.model.moe.expert_bias is False


@pytest.mark.parametrize("bias", [False, True])
def test_select_experts_is_the_forwards_choice(bias):
    """The one place the choice is made (the export's check and the routing probe replay it from the router's
    logits): its per-expert counts are the forward's, and with b it is the top-k of probs + b."""
    m = layer(bias=bias)
    if bias:
        with torch.no_grad():
            m.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.2)
    x = torch.randn(2, 6, D)
    m(x)
    probs = m.router(x.reshape(-1, D)).softmax(-1)
    chosen = m.select_experts(probs)
    assert chosen.shape == (12, K)
    assert torch.bincount(chosen.reshape(-1), minlength=E).tolist() == m.last_stats["tokens_per_expert"].tolist()
    want = (probs + (m.expert_bias if bias else 0.0)).topk(K, -1).indices
    assert torch.equal(chosen, want)
    if bias:
        assert not torch.equal(chosen, probs.topk(K, -1).indices)  # b changed a choice: the check can fail
