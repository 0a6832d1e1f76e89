"""MoE layer: grouped == loop (outputs and every gradient), dense equivalence, aux losses and their
micro-batch semantics, stats, roles, backend resolution. Tiny sizes; the whole file runs in seconds."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from nagmoe.config import MoEConfig
from nagmoe.base.errors import UserError
from nagmoe.model.moe import MoELayer, load_balancing_loss
from nagmoe.model.roles import param_roles
from nagmoe.ops.grouped_experts import (
    experts_grouped, experts_loop, experts_megablocks, grouped_mm_supports, resolve_expert_backend)

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
needs_grouped = pytest.mark.skipif(not HAS_GROUPED_MM, reason="torch._grouped_mm is missing (torch < 2.8)")


def make_layer(d=32, E=8, K=2, impl="loop", seed=0, lb=0.01, z=0.001, hidden=None):
    torch.manual_seed(seed)
    layer = MoELayer(d, MoEConfig(n_experts=E, top_k=K, impl=impl, lb_loss_weight=lb, z_loss_weight=z,
                                  expert_hidden=hidden))
    with torch.no_grad():  # w_out is zero at init: give it values so every gradient is non-trivial
        layer.w_out.normal_(0.0, layer.hidden ** -0.5)
    return layer


def twin(layer, impl):
    """Same weights, another expert backend."""
    cfg = MoEConfig(n_experts=layer.n_experts, top_k=layer.top_k, impl=impl, expert_hidden=layer.hidden,
                    lb_loss_weight=layer.lb_loss_weight, z_loss_weight=layer.z_loss_weight)
    other = MoELayer(layer.d_model, cfg)
    other.load_state_dict(layer.state_dict())
    assert other.backend == impl
    return other


def forward_backward(layer, x, grad_seed=1):
    x = x.clone().requires_grad_(True)
    y, aux = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed))
    ((y * g).sum() + aux).backward()
    grads = {"x": x.grad, "router": layer.router.weight.grad, "w_in": layer.w_in.grad, "w_out": layer.w_out.grad}
    return y.detach(), aux.detach(), grads


def route_case(layer, x, case):
    """Force routing by a constant input feature x[..., 0] = 1 and a large router weight on it."""
    if case == "random":
        return x
    x = x.clone()
    x[..., 0] = 1.0
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        if case == "empty_expert":
            layer.router.weight[0, 0] = -20.0  # expert 0 is never in the top-k
        elif case == "one_expert_all":
            layer.router.weight[3, 0] = 20.0  # expert 3 is in every token's top-k
    return x


# ----------------------------------------------------------------------------------------------------------
# grouped == loop
# ----------------------------------------------------------------------------------------------------------
@needs_grouped
@pytest.mark.parametrize("case,K", [("random", 2), ("empty_expert", 2), ("one_expert_all", 2),
                                    ("one_expert_all", 1)])
def test_grouped_equals_loop_outputs_and_all_gradients(case, K):
    loop = make_layer(d=32, E=8, K=K, impl="loop", seed=3)
    x = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(4))
    x = route_case(loop, x, case)
    grouped = twin(loop, "grouped")

    y_l, aux_l, g_l = forward_backward(loop, x)
    counts = loop.last_stats["tokens_per_expert"]
    y_g, aux_g, g_g = forward_backward(grouped, x)

    if case == "empty_expert":
        assert counts[0] == 0
    if case == "one_expert_all":
        assert counts[3] == 64  # every one of the N = 64 tokens
        if K == 1:
            assert counts.sum() == counts[3]  # all other experts are empty
    assert torch.equal(counts, grouped.last_stats["tokens_per_expert"])
    torch.testing.assert_close(y_g, y_l, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux_g, aux_l, atol=1e-6, rtol=1e-6)
    for name in g_l:
        assert g_l[name] is not None and g_l[name].abs().sum() > 0, name
        torch.testing.assert_close(g_g[name], g_l[name], atol=1e-5, rtol=1e-5, msg=name)
    if case == "empty_expert":  # an empty expert gets an exact zero gradient
        assert g_g["w_in"][0].abs().max() == 0 and g_g["w_out"][0].abs().max() == 0


@needs_grouped
@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 0, 0], [16, 0, 0, 0]])
def test_grouped_kernel_handles_empty_groups_and_stride0_grads(counts):
    # y.sum().backward() sends an expanded (stride-0) gradient: the case torch._grouped_mm rejects in fp32
    # on CPU unless the gradient is made contiguous.
    torch.manual_seed(0)
    counts_E = torch.tensor(counts)
    S, D, H = int(counts_E.sum()), 8, 12
    results = []
    for fn in (experts_loop, experts_grouped):
        x = torch.randn(S, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        w_in = torch.randn(4, D, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
        w_out = torch.randn(4, H, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y = fn(x, w_in, w_out, counts_E)
        assert y.shape == (S, D)
        if S:
            y.sum().backward()
            results.append((y.detach(), x.grad, w_in.grad, w_out.grad))
    if counts_E.sum():
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@needs_grouped
def test_grouped_falls_back_to_loop_for_unaligned_width():
    assert not grouped_mm_supports(torch.float32, "cpu", 18, 36)  # 18 floats = 72 bytes, not 16-aligned
    assert grouped_mm_supports(torch.float32, "cpu", 16, 32)
    assert not grouped_mm_supports(torch.float32, "cuda", 16, 32)  # the CUDA kernel is bf16-only
    loop = make_layer(d=18, E=4, K=2, impl="loop", seed=5)
    grouped = twin(loop, "grouped")
    x = torch.randn(2, 8, 18, generator=torch.Generator().manual_seed(6))
    with pytest.warns(UserWarning, match="slow loop"):
        y_g, _, g_g = forward_backward(grouped, x)
    y_l, _, g_l = forward_backward(loop, x)
    torch.testing.assert_close(y_g, y_l, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_g["w_in"], g_l["w_in"], atol=1e-5, rtol=1e-5)


@needs_grouped
def test_grouped_bf16_autocast_close_to_loop():
    loop = make_layer(d=32, E=4, K=2, impl="loop", seed=7)
    grouped = twin(loop, "grouped")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_l, aux_l = loop(x)
        y_g, aux_g = grouped(x)
    assert y_g.dtype == torch.bfloat16 and aux_g.dtype == torch.float32  # router and aux stay fp32
    torch.testing.assert_close(aux_g, aux_l)
    torch.testing.assert_close(y_g.float(), y_l.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or
                    __import__("importlib").util.find_spec("grouped_gemm") is None,
                    reason="megablocks' grouped_gemm imports only on a CUDA machine that has it built")
def test_megablocks_backend_matches_loop():  # pragma: no cover - CUDA only
    counts_E = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    w_in = torch.randn(4, 64, 96, device="cuda", dtype=torch.bfloat16) * 0.1
    w_out = torch.randn(4, 96, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    torch.testing.assert_close(experts_megablocks(x, w_in, w_out, counts_E),
                               experts_loop(x, w_in, w_out, counts_E), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------------------
# semantics
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["loop", pytest.param("grouped", marks=needs_grouped)])
def test_one_expert_top1_equals_dense_relu2_mlp(impl):
    layer = make_layer(d=16, E=1, K=1, impl=impl, seed=9, hidden=40)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(10))
    y, aux = layer(x)
    W_in, W_out = layer.w_in[0], layer.w_out[0]
    dense = F.relu(x @ W_in).square() @ W_out  # the gate of a single expert is softmax = 1
    torch.testing.assert_close(y, dense, atol=1e-5, rtol=1e-5)
    # LB = 1·(1·1) = 1; Z = mean(logit²) since logsumexp of one logit is the logit
    logit = x.reshape(-1, 16) @ layer.router.weight[0]
    torch.testing.assert_close(layer.last_stats["lb_loss"], torch.tensor(1.0))
    torch.testing.assert_close(layer.last_stats["z_loss"], logit.square().mean().detach())
    torch.testing.assert_close(aux, 0.01 * 1.0 + 0.001 * logit.square().mean(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("lb,z", [(1.0, 0.0), (0.0, 1.0), (0.01, 0.001)])
def test_aux_losses_reach_router_gradient(lb, z):
    layer = MoELayer(16, MoEConfig(n_experts=4, top_k=2, impl="loop", lb_loss_weight=lb, z_loss_weight=z))
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(11))
    _, aux = layer(x)
    assert aux.dim() == 0 and aux.requires_grad
    aux.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().max() > 0
    assert layer.w_in.grad is None and layer.w_out.grad is None  # aux losses touch only the router


def test_gates_are_unrenormalised_topk_probabilities():
    layer = make_layer(d=16, E=4, K=2, impl="loop", seed=12)
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(13))
    y, _ = layer(x)
    probs = (x.reshape(-1, 16) @ layer.router.weight.T).softmax(-1)
    gate, idx = probs.topk(2, dim=-1)
    expected = torch.zeros(6, 16)
    for n in range(6):
        for k in range(2):
            e = idx[n, k]
            expected[n] += gate[n, k] * (F.relu(x[0, n] @ layer.w_in[e]).square() @ layer.w_out[e])
    torch.testing.assert_close(y[0], expected.detach(), atol=1e-5, rtol=1e-5)
    assert (gate.sum(-1) < 1).all()  # the test is meaningful: renormalising would change the output


def test_balanced_router_gives_lb_minimum_one():
    # zero router weights: uniform probabilities -> LB = E·Σ_e f_e/E = 1 whatever the tie-broken top-k
    layer = MoELayer(16, MoEConfig(n_experts=4, top_k=2, impl="loop"))
    torch.nn.init.zeros_(layer.router.weight)
    layer(torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(14)))
    torch.testing.assert_close(layer.last_stats["lb_loss"], torch.tensor(1.0))
    # constructed balanced assignment with peaked probabilities: token n has feature n mod 4 -> expert n mod 4
    layer = MoELayer(8, MoEConfig(n_experts=4, top_k=1, impl="loop"))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :4] = 5.0 * torch.eye(4)
    x = torch.zeros(1, 12, 8)
    x[0, torch.arange(12), torch.arange(12) % 4] = 1.0
    layer(x)
    assert layer.last_stats["tokens_per_expert"].tolist() == [3, 3, 3, 3]
    torch.testing.assert_close(layer.last_stats["lb_loss"], torch.tensor(1.0))
    # the same tokens all sent to expert 0 with peaked probabilities: LB -> E (the maximum)
    with torch.no_grad():
        layer.router.weight[0, :4] = 50.0
    layer(x)
    assert layer.last_stats["tokens_per_expert"].tolist() == [12, 0, 0, 0]
    assert layer.last_stats["lb_loss"] > 3.9


def test_lb_and_z_losses_match_the_documented_formulas():
    torch.manual_seed(15)
    logits = torch.randn(20, 6)
    probs = logits.softmax(-1)
    idx = probs.topk(3, dim=-1).indices
    f = F.one_hot(idx, 6).sum(1).float().mean(0) / 3  # fraction of the N·K slots per expert
    expected = 6 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(load_balancing_loss(probs, torch.bincount(idx.flatten(), minlength=6), 3), expected)


def _hand_aux(layer, x):
    """aux loss of one micro-batch computed independently from the documented definition."""
    logits = x.reshape(-1, x.shape[-1]) @ layer.router.weight.T
    probs = logits.softmax(-1)
    idx = probs.topk(layer.top_k, dim=-1).indices
    f = F.one_hot(idx, layer.n_experts).sum(1).float().mean(0) / layer.top_k
    lb = layer.n_experts * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return layer.lb_loss_weight * lb + layer.z_loss_weight * z


def test_aux_loss_micro_batch_semantics_is_the_mean_of_per_micro_batch_losses():
    layer = MoELayer(8, MoEConfig(n_experts=4, top_k=1, impl="loop", lb_loss_weight=1.0, z_loss_weight=0.1))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, :4] = 6.0 * torch.eye(4)
    # micro-batch 1 routes everything to expert 0, micro-batch 2 everything to expert 1: each is maximally
    # imbalanced (LB ~ E) while the concatenated batch is half-balanced (LB ~ E/2)
    x = torch.zeros(4, 5, 8)
    x[:2, :, 0] = 1.0
    x[2:, :, 1] = 1.0
    x = x + 0.05 * torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(16))
    micro = [x[:2], x[2:]]

    # the trainer's accumulation: backward of aux / n_micro per micro-batch
    for mb in micro:
        _, aux = layer(mb)
        torch.testing.assert_close(aux, _hand_aux(layer, mb))
        (aux / len(micro)).backward()
    grad_accumulated = layer.router.weight.grad.clone()

    layer.router.weight.grad = None
    expected = sum(_hand_aux(layer, mb) for mb in micro) / len(micro)
    expected.backward()
    torch.testing.assert_close(grad_accumulated, layer.router.weight.grad)

    # and it is NOT the loss of the concatenated batch (f·P is not linear in the batch)
    _, aux_full = layer(x)
    assert aux_full < 0.75 * expected.detach()
    # nothing is carried across calls: the same micro-batch gives the same loss again
    torch.testing.assert_close(layer(micro[0])[1], layer(micro[0])[1])


def test_last_stats_are_detached_per_call_metrics():
    layer = make_layer(d=16, E=4, K=2, impl="loop", seed=17)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(18))
    _, aux = layer(x)
    s = layer.last_stats
    assert set(s) == {"lb_loss", "z_loss", "tokens_per_expert", "router_entropy_sum", "router_tokens",
                      "dropped_slots"}
    assert s["tokens_per_expert"].dtype == torch.long and s["tokens_per_expert"].shape == (4,)
    assert int(s["tokens_per_expert"].sum()) == 3 * 7 * 2 and int(s["router_tokens"]) == 3 * 7
    assert 0 < float(s["router_entropy_sum"]) <= 3 * 7 * torch.log(torch.tensor(4.0))
    assert not any(v.requires_grad for v in s.values())
    torch.testing.assert_close(aux.detach(), 0.01 * s["lb_loss"] + 0.001 * s["z_loss"])
    other = make_layer(d=16, E=4, K=2, impl="loop", seed=17)
    assert other.last_stats == {}  # per-module state, nothing shared


# ----------------------------------------------------------------------------------------------------------
# construction, roles, backend resolution
# ----------------------------------------------------------------------------------------------------------
def test_roles_init_and_shapes():
    layer = MoELayer(64, MoEConfig(n_experts=8, top_k=2))
    assert param_roles(layer) == {"router.weight": "router", "w_in": "matrix", "w_out": "matrix"}
    assert layer.hidden == 4 * 64 // 2
    assert layer.w_in.shape == (8, 64, 128) and layer.w_out.shape == (8, 128, 64)
    assert layer.router.weight.shape == (8, 64) and layer.router.bias is None
    assert layer.w_out.abs().max() == 0
    assert abs(layer.w_in.std().item() - 64 ** -0.5) < 0.1 * 64 ** -0.5
    y, _ = layer(torch.randn(1, 4, 64))
    assert y.abs().max() == 0  # zero-initialised output, like the dense MLP
    assert MoELayer(64, MoEConfig(n_experts=8, top_k=2, expert_hidden=24)).hidden == 24


def test_bad_moe_config_is_a_user_error():
    with pytest.raises(UserError, match="top_k"):
        MoELayer(16, MoEConfig(n_experts=4, top_k=5))
    with pytest.raises(UserError, match="model.moe.impl"):
        MoELayer(16, MoEConfig(impl="triton"))


def test_backend_resolution():
    assert resolve_expert_backend("loop") == "loop"
    if HAS_GROUPED_MM:
        assert resolve_expert_backend("auto") == "grouped"
    else:
        with pytest.warns(UserWarning, match="slow backend"):
            assert resolve_expert_backend("auto") == "loop"
    if __import__("importlib").util.find_spec("grouped_gemm") is None:
        with pytest.warns(UserWarning, match="megablocks"):
            assert resolve_expert_backend("megablocks") == ("grouped" if HAS_GROUPED_MM else "loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_expert_backend("loop")  # an explicit reference choice does not warn


# ----------------------------------------------------------------------------------------------------------
# in the model
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_moe_model_overfits_a_fixed_batch(residual):
    from nagmoe.config import AttentionConfig, ModelConfig, NAGConfig
    from nagmoe.model import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(residual=residual, vocab_size=64, d_model=32, n_layers=2, max_seq_len=32, ffn="moe",
                      attention=AttentionConfig(n_heads=2), moe=MoEConfig(n_experts=4, top_k=2),
                      nag=NAGConfig(C=8))
    model = build_model(cfg)
    roles = param_roles(model)
    moe_layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(moe_layers) == 2
    assert sum(r == "router" for r in roles.values()) == 2
    routers_before = [m.router.weight.detach().clone() for m in moe_layers]

    idx = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        out = model(idx[:, :-1], idx[:, 1:])
        assert out.aux_loss.dim() == 0 and torch.isfinite(out.aux_loss) and out.aux_loss > 0
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    for m, before in zip(moe_layers, routers_before):
        assert int(m.last_stats["tokens_per_expert"].sum()) == 4 * 32 * 2
        assert not torch.equal(m.router.weight, before)
