import pytest
import torch

from nagmoe.config import TrainConfig
from nagmoe.model.roles import CONV, EMBEDDING, GATE, MATRIX, ROUTER, SCALAR, UNEMBEDDING
from nagmoe.train.optim import ADAMW_BETAS, Muon, build_optimizers, muon_shape_scale, orthogonalise

from role_toy import EXPECTED_MUON, ToyModel, toy_batch


def _svals(x):
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("shape", [(24, 24), (40, 12), (12, 40)])
def test_orthogonalise_2d_singular_values_near_one(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = orthogonalise(g)
    s = _svals(o)
    assert o.shape == g.shape and o.dtype == g.dtype
    assert s.min() > 0.6 and s.max() < 1.3, s
    # Same singular vectors as the exact polar factor U V^T: U^T O V is (nearly) diagonal.
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    core = u.T @ o.double() @ vh.T
    off_diag = core - torch.diag(torch.diagonal(core))
    assert off_diag.abs().max() < 1e-4


def test_orthogonalise_3d_each_expert_separately():
    gen = torch.Generator().manual_seed(2)
    # Experts at wildly different scales: a stack-wide normalisation would leave the small ones near 0.
    stack = torch.stack([torch.randn(16, 32, generator=gen) * s for s in (1e-3, 1.0, 1e3)])
    o = orthogonalise(stack)
    for e in range(stack.size(0)):
        s = _svals(o[e])
        assert s.min() > 0.6 and s.max() < 1.3, (e, s)
        torch.testing.assert_close(o[e], orthogonalise(stack[e]), rtol=0, atol=1e-5)


def test_muon_step_formula_matches_definition():
    torch.manual_seed(0)
    w0 = torch.randn(12, 6)
    p = torch.nn.Parameter(w0.clone())
    lr, mu, wd = 0.05, 0.9, 0.1
    opt = Muon([p], lr=lr, momentum=mu, weight_decay=wd)
    g = torch.randn(12, 6)
    p.grad = g.clone()
    opt.step()
    buf = (1 - mu) * g  # EMA from zero
    update = (1 - mu) * g + mu * buf  # Nesterov
    expected = w0 * (1 - lr * wd) - lr * (12 / 6) ** 0.5 * orthogonalise(update)
    # lerp vs the written-out EMA: fp32 rounding of the same sums (1.2e-7 measured, any ATEN_CPU_CAPABILITY); Muon
    # divides by no per-element RMS (Newton-Schulz is a fixed polynomial of the Frobenius-normalised matrix)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    assert muon_shape_scale(torch.Size([4, 6, 12])) == 1.0


def test_muon_3d_stack_equals_per_expert_2d():
    gen = torch.Generator().manual_seed(3)
    stack0 = torch.randn(3, 20, 8, generator=gen)
    grads = [torch.randn(3, 20, 8, generator=gen) for _ in range(3)]
    stacked = torch.nn.Parameter(stack0.clone())
    singles = [torch.nn.Parameter(stack0[e].clone()) for e in range(3)]
    kw = dict(lr=0.03, momentum=0.95, weight_decay=0.01)
    opt_stack, opt_single = Muon([stacked], **kw), Muon(singles, **kw)
    for g in grads:
        stacked.grad = g.clone()
        for e, p in enumerate(singles):
            p.grad = g[e].clone()
        opt_stack.step()
        opt_single.step()
    for e, p in enumerate(singles):  # the same per-matrix ops (measured bitwise)
        torch.testing.assert_close(stacked.detach()[e], p.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(stacked.detach(), stack0)


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="needs matrices"):
        Muon([torch.nn.Parameter(torch.zeros(5))])


def test_groups_by_role_never_by_ndim():
    torch.manual_seed(0)
    model = ToyModel()
    cfg = TrainConfig(lr_matrix=0.02, lr_embed=0.2, lr_unembed=0.008, lr_scalar=5e-3, lr_gate=1e-3,
                      lr_router=2e-3, muon_momentum=0.9, weight_decay=0.1)
    bundle = build_optimizers(model, cfg)
    assert sorted(bundle.muon_param_names()) == sorted(EXPECTED_MUON)
    by_role = bundle.param_names_by_role()
    assert by_role[EMBEDDING] == ["wte.weight"]
    assert by_role[UNEMBEDDING] == ["lm_head.weight"]
    assert sorted(by_role[CONV]) == ["conv.bias", "conv.weight"]
    assert by_role[SCALAR] == ["g_encode"]
    assert sorted(by_role[ROUTER]) == ["blocks.0.moe.router.weight", "blocks.1.moe.router.weight"]
    assert "blocks.0.gate.weight" in by_role[GATE] and len(by_role[GATE]) == 10  # 2-D gate weight: AdamW
    # Every trainable parameter is in exactly one group.
    all_names = [n for names in by_role.values() for n in names]
    assert sorted(all_names) == sorted(n for n, _ in model.named_parameters())
    expected_lr = {MATRIX: 0.02, EMBEDDING: 0.2, UNEMBEDDING: 0.008, CONV: 5e-3, SCALAR: 5e-3, GATE: 1e-3,
                   ROUTER: 2e-3}
    muon = bundle.by_kind["muon"]
    assert isinstance(muon, Muon)
    assert muon.param_groups[0]["momentum"] == 0.9 and muon.param_groups[0]["weight_decay"] == 0.1
    for group in bundle.by_kind["adamw"].param_groups:
        assert group["betas"] == ADAMW_BETAS and group["weight_decay"] == 0.0
    for group in bundle.param_groups:
        assert group["lr"] == group["initial_lr"] == expected_lr[group["role"]]
    bundle.set_lr_multiplier(0.5)
    for group in bundle.param_groups:
        assert group["lr"] == pytest.approx(0.5 * expected_lr[group["role"]])
    assert len(bundle.describe()) == len(bundle.param_groups)


def test_bundle_decreases_loss_and_zero_grad():
    torch.manual_seed(0)
    model = ToyModel()
    bundle = build_optimizers(model, TrainConfig(lr_gate=1e-2, lr_router=1e-2))
    idx, targets = toy_batch()
    losses = []
    for _ in range(25):
        bundle.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        bundle.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    bundle.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_bundle_state_dict_round_trip():
    torch.manual_seed(0)
    model = ToyModel()
    bundle = build_optimizers(model, TrainConfig())
    idx, targets = toy_batch()
    model(idx, targets).backward()
    bundle.step()
    state = bundle.state_dict()
    assert set(state) == {"muon", "adamw"}
    other = build_optimizers(model, TrainConfig())
    other.load_state_dict(state)
    assert all(torch.equal(other.by_kind["muon"].state[p]["momentum_buffer"], s["momentum_buffer"])
               for p, s in bundle.by_kind["muon"].state.items())
    with pytest.raises(ValueError, match="bundle has"):
        other.load_state_dict({"muon": state["muon"]})


@pytest.mark.gpu
def test_orthogonalise_bf16_on_cuda():
    g = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(4)).cuda()
    o = orthogonalise(g)  # bf16 Newton-Schulz on CUDA
    assert o.dtype == g.dtype
    s = torch.linalg.svdvals(o.double())
    assert s.min() > 0.5 and s.max() < 1.4, s
    reference = orthogonalise(g.cpu())  # fp32 on CPU
    assert (o.cpu() - reference).norm() / reference.norm() < 0.05
