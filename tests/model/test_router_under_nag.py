"""The router learns under NAG (issue 22): the LM loss reaches the router under every residual and top_k,
with and without MoD, through the step gain g·S/stopgrad(S); MoD's base vectors do not collapse routing at
initialisation; old run dirs keep their legacy gate form and base init."""
import os

import pytest
import torch

from nagmoe.config import load_config
from nagmoe.model import build_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
NO_BALANCING = ("model.moe.lb_loss_weight=0", "model.moe.z_loss_weight=0", "model.nag.warmup_tokens=0")


def router_over_expert_grad(*overrides, seed=0) -> float:
    """|grad router| / |grad w_in| over all MoE layers, LM loss only, fp32, at init with w_out made nonzero."""
    cfg = load_config(TINY, [*NO_BALANCING, "model.attention.kind=mha", *overrides])
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.w_out.normal_(std=cfg.model.d_model ** -0.5)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed))
    out = model(idx, torch.roll(idx, -1, dims=1))
    out.loss.backward()
    router = sum(b.ffn.router.weight.grad.square().sum() for b in model.blocks).sqrt()
    w_in = sum(b.ffn.w_in.grad.square().sum() for b in model.blocks).sqrt()
    return float(router / w_in)


@pytest.fixture(scope="module")
def prenorm_top1():
    return router_over_expert_grad("model.residual=prenorm", "model.moe.top_k=1")


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("mod", [False, True])
def test_the_router_gets_the_lm_gradient_under_nag(top_k, mod, prenorm_top1):
    extra = ("model.mod.skip_rate=0.2", "model.mod.start_tokens=0") if mod else ()
    ratio = router_over_expert_grad("model.residual=nag", f"model.moe.top_k={top_k}", *extra)
    assert prenorm_top1 / 10 <= ratio <= prenorm_top1 * 10, (ratio, prenorm_top1)


def test_without_the_step_gain_form_nag_top1_starves_the_router(prenorm_top1):
    """Control (the legacy form): the normalised branch output cancels the top-1 gate."""
    ratio = router_over_expert_grad("model.residual=nag", "model.moe.top_k=1", "model.moe.gate_grad=none")
    assert ratio < prenorm_top1 * 1e-3


@pytest.mark.parametrize("biased", [False, True])
def test_autograd_agrees_with_the_analytic_gradient_of_the_step_gain_form(biased):
    """One NAG update around a top-1 MoE: with step gain g·S/sg(S) the router weight gradient is
    Σ_n g_n·∂L/∂g_n · (e_k(n) - p_n) ⊗ x_n (∂L/∂log S = g·∂L/∂g, S = p_k(n), softmax Jacobian). With the
    loss-free expert bias (issue 43) k(n) is the biased choice argmax(p_n + b) and the form is otherwise the same:
    b moves the selection, not the gradient's shape."""
    from nagmoe.config import MoEConfig
    from nagmoe.model.moe import MoELayer
    from nagmoe.ops.nag_math import nag_update, rms_normalise

    torch.manual_seed(3)
    d, n = 32, 24
    moe = MoELayer(d, MoEConfig(n_experts=4, top_k=1, expert_hidden=16, impl="loop", lb_loss_weight=0,
                                z_loss_weight=0, expert_bias=biased), gate_scale_output=True).double()
    with torch.no_grad():
        moe.w_out.normal_(std=d ** -0.5)
        if biased:
            moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, -0.2]))
    x = rms_normalise(torch.randn(1, n, d, dtype=torch.float64))
    log_norm = torch.zeros(1, n, dtype=torch.float64)
    g = torch.full((1, n), 0.7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, n, d, dtype=torch.float64)
    y, _, gate_scale = moe(x)
    new_log_norm, new_direction = nag_update(log_norm, x, y, g * gate_scale, eps=1e-12)
    loss = (new_direction * w).sum() + (new_log_norm * torch.linspace(0, 1, n, dtype=torch.float64)).sum()
    loss.backward()
    with torch.no_grad():
        p = torch.softmax(moe.router(x[0]), dim=-1).double()  # (n, E); the router computes in fp32
        chosen = (p + (moe.expert_bias if biased else 0.0)).argmax(-1)
        if biased:  # the bias changed some choices (the check can fail)
            assert (chosen != p.argmax(-1)).any()
        coeff = (g.detach() * g.grad)[0]  # g·∂L/∂g per token
        dlogits = coeff[:, None] * (torch.nn.functional.one_hot(chosen, 4).double() - p)
        analytic = dlogits.T @ x[0]
    torch.testing.assert_close(moe.router.weight.grad, analytic, rtol=1e-4, atol=1e-7)  # fp32 router


def r40_copy(name: str, *overrides):
    """configs/paper/NAME.yaml with only d_model and expert_hidden reduced (its n_layers, n_experts, top_k, C,
    init scales and the warm-up state as built)."""
    cfg = load_config(os.path.join(REPO, "configs", "paper", f"{name}.yaml"),
                      ["model.d_model=128", "model.moe.expert_hidden=64",
                       *overrides])
    return cfg


def worst_layer_load(cfg, tokens_BT) -> float:
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ratios = []
    with torch.no_grad():
        model(tokens_BT)
        for block in model.blocks:
            counts = block.ffn.last_stats["tokens_per_expert"].float()
            ratios.append(float(counts.max() / counts.mean()))
    return max(ratios)


def text_tokens(n=508):
    """508 tokens of text: the bytes of the offline corpus's first scene (byte ids are valid in any vocab)."""
    from nagmoe.data.corpus import iter_documents, resolve_corpus

    text = next(iter(iter_documents(resolve_corpus("shakespeare"))))
    return torch.tensor(list(text.encode()[:n]), dtype=torch.long).view(4, n // 4)


# the r40 geometry issue 22 measured (26 blocks, 16 experts, top-1) and today's controlled-sweep r40 (issue 24)
GEOMETRIES = {"issue22": ("model.n_layers=26", "model.moe.n_experts=16", "model.moe.top_k=1"), "sweep": ()}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("base_init_std,bound", [(None, 1.5), (0.02, None)])
def test_mod_routing_at_init_is_as_spread_as_full_depth(base_init_std, bound, geometry):
    """The worst layer's max/mean expert load of nag-mod20-r40 at init is at most 1.5x nag-r40's on the same
    tokens; with the legacy base init (N(0, 0.02²)) it is not (the collapse this fixes)."""
    tokens = text_tokens()
    full = worst_layer_load(r40_copy("nag-r40", *GEOMETRIES[geometry]), tokens)
    extra = () if base_init_std is None else (f"model.mod.base_init_std={base_init_std}",)
    mod = worst_layer_load(r40_copy("nag-mod20-r40", *GEOMETRIES[geometry], *extra), tokens)
    if bound is not None:
        assert mod <= bound * full, (mod, full)
    else:
        assert mod > 1.5 * full, (mod, full)
