"""Stacked Muon (issue 60, item 3; train.muon_impl=stacked): one batched Newton-Schulz per stack of matrices of
one wide shape, equal per matrix to the loop over a real model's Muon parameters (2-D attention and MLP
matrices, 3-D expert stacks, tall and wide), with the same state and checkpoints; compiled as one graph per stack
that a new learning rate does not recompile."""
import copy
import dataclasses

import pytest
import torch

from nagmoe.config import load_config
from nagmoe.model import build_model
from nagmoe.ops.newton_schulz import orthogonalise, orthogonalise_stack, wide_shape
from nagmoe.train import optim as optim_mod
from nagmoe.train.optim import Muon, build_optimizers, resolve_muon_impl

# wide and square matrices enter the stack as they are: per matrix the loop's ops on the same layout (bitwise
# on this CPU; a batched GEMM may pick another kernel elsewhere, hence a tolerance, not equality)
WIDE_RTOL = 1e-6
# a tall matrix enters transposed as a contiguous copy while the loop iterates on the transposed *view*: the
# GEMMs accumulate in another order and the 5 Newton-Schulz steps amplify that rounding (1.3e-6 measured)
TALL_RTOL = 5e-6


def small_model_cfg(*overrides):
    """tiny.yaml at d_model 32, 2 layers, a MoE with 4 experts: attention (square), MLP-shaped expert stacks
    (E, 48, 32) tall and (E, 32, 48) wide, the CCA / NAG matrices of the real model."""
    return load_config("configs/tiny.yaml", [
        "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
        "model.attention.n_heads=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=48",
        "model.ffn=moe", "data.seq_len=64", *overrides])


def twin_bundles(impl_b="stacked", **train_b):
    """The same model twice, Muon `loop` on the first and `impl_b` on the second (plus its train overrides)."""
    cfg = small_model_cfg()
    torch.manual_seed(0)
    model_a = build_model(cfg.model)
    model_b = copy.deepcopy(model_a)
    bundle_a = build_optimizers(model_a, dataclasses.replace(cfg.train, muon_impl="loop"))
    bundle_b = build_optimizers(model_b, dataclasses.replace(cfg.train, muon_impl=impl_b, **train_b))
    return (model_a, bundle_a), (model_b, bundle_b)


def same_grads(model_a, model_b, gen):
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def tolerance(shape):
    return TALL_RTOL if shape[-2] > shape[-1] else WIDE_RTOL


def test_stacks_cover_the_real_models_shapes():
    (_, _), (_, bundle) = twin_bundles()
    muon = bundle.by_kind["muon"]
    assert muon.impl == "stacked" and not muon.compile  # CPU: train.compile auto = off
    group = muon.param_groups[0]
    for p in group["params"]:
        p.grad = torch.zeros_like(p)
    stacks = muon.stacks(0, group)
    shapes = [tuple(p.shape) for p in group["params"]]
    assert any(len(s) == 3 for s in shapes), shapes  # 3-D expert stacks
    assert any(s[-2] > s[-1] for s in shapes) and any(s[-2] < s[-1] for s in shapes), shapes  # tall and wide
    # every Muon matrix in exactly one stack, one stack per wide shape, fewer calls than matrices
    members = sorted(i for _, idx in stacks for i in idx)
    assert members == list(range(len(shapes)))
    assert len(stacks) == len({wide_shape(s) for s in shapes}) < len(shapes)  # small: no stack is cut
    for (_, member_shapes, _, _), idx in stacks:
        assert len({wide_shape(shapes[i]) for i in idx}) == 1 and member_shapes == tuple(shapes[i] for i in idx)


def test_long_stacks_are_cut_and_equal_runs_share_one_compiled_step(monkeypatch):
    """STACK_ELEMENTS bounds a stack's temporaries: a run of one wide shape is cut at parameter boundaries; the
    cut changes no result, and runs of equal member shapes share one compiled graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(optim_mod, "STACK_ELEMENTS", 1100)  # two 16 x 32 matrices; an expert stack alone
    monkeypatch.setattr(optim_mod, "STACK_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    (model_a, bundle_a), (model_b, bundle_b) = twin_bundles(compile="true")
    muon_a, muon_b = bundle_a.by_kind["muon"], bundle_b.by_kind["muon"]
    group = muon_b.param_groups[0]
    gen = torch.Generator().manual_seed(6)
    for _ in range(1):
        same_grads(model_a, model_b, gen)
        muon_a.step()
        muon_b.step()
        assert_weights_close(muon_a.param_groups[0]["params"], group["params"], group["param_names"], "cut")
    stacks = muon_b.stacks(0, group)
    sizes = [sum(group["params"][i].numel() for i in idx) for _, idx in stacks]
    assert all(size <= 1100 or len(idx) == 1 for size, (_, idx) in zip(sizes, stacks)), sizes
    assert sorted(i for _, idx in stacks for i in idx) == list(range(len(group["params"])))
    keys = {key for key, _ in stacks}
    assert len(keys) < len(stacks)  # some runs are alike ...
    assert len(muon_b._compiled) == len(keys) == counters["stats"]["unique_graphs"]  # ... and share a graph
    torch._dynamo.reset()


def assert_weights_close(params_a, params_b, names, where):
    """Per matrix (an expert stack is E matrices) |W_b - W_a| / |W_a| within `tolerance`. On the weights, not on
    the step W' - W: the stacked step applies lr as an fp32 device scalar (the loop: a double cast to fp32 by add_), and
    an update ~1e-3 on weights ~0.2 rounds to the weights' ulp, far above the update's own 1e-6."""
    for name, p, q in zip(names, params_a, params_b):
        wa, wb = p.detach().reshape(-1, *p.shape[-2:]), q.detach().reshape(-1, *p.shape[-2:])
        for k in range(wa.size(0)):
            assert rel(wb[k], wa[k]) <= tolerance(p.shape), (where, name, tuple(p.shape), k, rel(wb[k], wa[k]))


def test_stacked_step_equals_the_loop_per_matrix():
    (model_a, bundle_a), (model_b, bundle_b) = twin_bundles()
    gen = torch.Generator().manual_seed(1)
    muon_a, muon_b = bundle_a.by_kind["muon"], bundle_b.by_kind["muon"]
    names = muon_a.param_groups[0]["param_names"]
    params_a, params_b = muon_a.param_groups[0]["params"], muon_b.param_groups[0]["params"]
    for step in range(3):
        bundle_a.set_lr_multiplier(1.0 - 0.3 * step)  # the stacked step takes lr as a device scalar
        bundle_b.set_lr_multiplier(1.0 - 0.3 * step)
        same_grads(model_a, model_b, gen)
        muon_a.step()
        muon_b.step()
        assert_weights_close(params_a, params_b, names, step)
        for name, p, q in zip(names, params_a, params_b):
            ba, bb = muon_a.state[p]["momentum_buffer"], muon_b.state[q]["momentum_buffer"]
            assert torch.equal(ba, bb), name  # momentum: the same lerp, elementwise, bitwise
    # and the orthogonalised updates themselves, matrix by matrix, as the two paths form them
    group = muon_a.param_groups[0]
    updates = [p.grad.lerp(muon_a.state[p]["momentum_buffer"], group["momentum"]) for p in params_a]
    for (_, _, _, _), idx in muon_b.stacks(0, muon_b.param_groups[0]):
        stacked = orthogonalise_stack([updates[i] for i in idx])
        for i, o in zip(idx, stacked):
            ref = orthogonalise(updates[i])
            for k in range(o.reshape(-1, *o.shape[-2:]).size(0)):
                a, b = o.reshape(-1, *o.shape[-2:])[k], ref.reshape(-1, *o.shape[-2:])[k]
                assert rel(a, b) <= tolerance(o.shape), (names[i], k, rel(a, b))


def test_orthogonalise_stack_equals_orthogonalise():
    gen = torch.Generator().manual_seed(2)
    # one wide shape (16, 40): wide 2-D, tall 2-D, a wide 3-D stack, a tall 3-D stack, at different scales
    updates = [torch.randn(16, 40, generator=gen), torch.randn(40, 16, generator=gen) * 1e3,
               torch.randn(3, 16, 40, generator=gen) * 1e-3, torch.randn(2, 40, 16, generator=gen)]
    outs = orthogonalise_stack(updates)
    for u, o in zip(updates, outs):
        assert o.shape == u.shape and o.dtype == u.dtype
        ref = orthogonalise(u)
        for k in range(o.reshape(-1, *u.shape[-2:]).size(0)):
            a, b = o.reshape(-1, *u.shape[-2:])[k], ref.reshape(-1, *u.shape[-2:])[k]
            assert rel(a, b) <= tolerance(u.shape), (tuple(u.shape), k, rel(a, b))


def test_state_dict_is_the_same_and_resumes_across_the_switch():
    (model_a, bundle_a), (model_b, bundle_b) = twin_bundles()
    gen = torch.Generator().manual_seed(3)
    same_grads(model_a, model_b, gen)
    bundle_a.step()
    bundle_b.step()
    sa, sb = bundle_a.state_dict(), bundle_b.state_dict()
    assert sa["muon"]["param_groups"] == sb["muon"]["param_groups"]
    assert sa["muon"]["state"].keys() == sb["muon"]["state"].keys()
    for k in sa["muon"]["state"]:
        assert sa["muon"]["state"][k].keys() == sb["muon"]["state"][k].keys() == {"momentum_buffer"}
    # a loop run's state loads into a stacked Muon and the next step equals the loop's continuation
    model_c = copy.deepcopy(model_a)
    cfg = small_model_cfg()
    bundle_c = build_optimizers(model_c, dataclasses.replace(cfg.train, muon_impl="stacked"))
    bundle_c.load_state_dict(copy.deepcopy(sa))  # state_dict() holds the live buffers: no sharing
    same_grads(model_a, model_c, gen)
    muon_a, muon_c = bundle_a.by_kind["muon"], bundle_c.by_kind["muon"]
    pa, pc = muon_a.param_groups[0]["params"], muon_c.param_groups[0]["params"]
    muon_a.step()
    muon_c.step()
    assert_weights_close(pa, pc, muon_a.param_groups[0]["param_names"], "resumed")
    for p, q in zip(pa, pc):
        assert torch.equal(muon_a.state[p]["momentum_buffer"], muon_c.state[q]["momentum_buffer"])


def test_compiled_stack_step_one_graph_per_stack_no_recompile(monkeypatch):
    """The compiled path traced (aot_eager: the same graph capture and functionalisation as inductor, seconds
    on a CPU): fullgraph (no host read), one graph per stack that later steps and new lrs reuse, equal to the
    loop within the same tolerances."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(optim_mod, "STACK_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    (model_a, bundle_a), (model_b, bundle_b) = twin_bundles(compile="true")
    muon_a, muon_b = bundle_a.by_kind["muon"], bundle_b.by_kind["muon"]
    assert muon_b.compile
    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        for b in (bundle_a, bundle_b):
            b.set_lr_multiplier(0.5 + 0.2 * step)
        same_grads(model_a, model_b, gen)
        muon_a.step()
        muon_b.step()
        assert_weights_close(muon_a.param_groups[0]["params"], muon_b.param_groups[0]["params"],
                             muon_a.param_groups[0]["param_names"], step)
    n_stacks = len(muon_b.stacks(0, muon_b.param_groups[0]))
    assert len(muon_b._compiled) == n_stacks
    assert counters["stats"]["unique_graphs"] == n_stacks, dict(counters["stats"])  # 2 steps, 2 lrs: no recompile
    torch._dynamo.reset()


def test_resolution_and_refusals():
    assert resolve_muon_impl("auto", "cpu") == "loop"  # the CPU's numbers do not move (make demo)
    assert resolve_muon_impl("auto", "cuda") == "stacked"
    assert resolve_muon_impl("stacked", "cpu") == "stacked"
    with pytest.raises(ValueError, match="muon_impl"):
        resolve_muon_impl("fast", "cpu")
    with pytest.raises(ValueError, match="loop or stacked"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2))], impl="auto")
    cfg = small_model_cfg()
    torch.manual_seed(0)
    assert build_optimizers(build_model(cfg.model), cfg.train).by_kind["muon"].impl == "loop"  # default, CPU


@pytest.mark.gpu
def test_cuda_default_is_stacked_compiled_and_close_to_the_loop():
    """On CUDA, train.muon_impl auto = stacked, compiled (inductor) under train.compile auto; bf16 Newton-Schulz
    in another batch may take other cuBLAS kernels: each matrix's update within the distributed Muon's bf16
    tolerance (nagmoe/parallel/distributed_muon.py BF16_RTOL) of the loop's."""
    from nagmoe.parallel.distributed_muon import BF16_RTOL

    cfg = small_model_cfg()
    torch.manual_seed(0)
    model_a = build_model(cfg.model).cuda()
    model_b = copy.deepcopy(model_a)
    loop = build_optimizers(model_a, dataclasses.replace(cfg.train, muon_impl="loop")).by_kind["muon"]
    stacked = build_optimizers(model_b, cfg.train).by_kind["muon"]
    assert stacked.impl == "stacked" and stacked.compile
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        for p, q in zip(model_a.parameters(), model_b.parameters()):
            p.grad = torch.randn(p.shape, generator=gen).cuda()
            q.grad = p.grad.clone()
        pa, pb = loop.param_groups[0]["params"], stacked.param_groups[0]["params"]
        before_a, before_b = [p.detach().clone() for p in pa], [q.detach().clone() for q in pb]
        loop.step()
        stacked.step()
        for wa, wb, p, q in zip(before_a, before_b, pa, pb):
            da, db = (p - wa).reshape(-1, *p.shape[-2:]), (q - wb).reshape(-1, *p.shape[-2:])
            for k in range(da.size(0)):
                assert rel(db[k], da[k]) <= BF16_RTOL, (tuple(p.shape), k, rel(db[k], da[k]))
