"""Issue 60, item 5 (the MoE glue): the slot permutation's backward is a gather by the inverse permutation (no
index_put into a zero-filled buffer), and the expert stacks are cast to the compute dtype once per weight write
rather than at every use (micro-step, checkpoint recompute). Both give the values of the code they replace:
  - the permutation: each row of the gradient receives exactly ONE gradient (a permutation, no sum), so the
    gather by the inverse equals index_put's 0 + g bitwise; the sum over K after it is the same reduction in the
    same order as the expand's backward it replaces;
  - the cast: the same `w.to(dtype)` values, made once; the gradient cast back to fp32 as `.to`'s backward.
Hence torch.equal everywhere below, fp32 and bf16 (CPU autocast, which takes CUDA's choice here)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import nagmoe.model.moe as moe_module
from nagmoe.config import MoEConfig
from nagmoe.model.moe import MoELayer
from nagmoe.ops.permute import inverse_permutation, permute_rows
from mod_models import batch, dialled, r40_small, step, with_edge_rows


def indexed_rows(x, order, inverse, repeat=1, partial=None):
    """The parent's advanced indexing (backward: index_put into zeros): the oracle of `permute_rows`."""
    if partial == "in":
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[order]
    if repeat > 1:
        N, D = x.shape
        return x.unsqueeze(1).expand(N, repeat, D)[order // repeat, order % repeat]
    return x[order]


def uncached(layer):
    """The layer casting its stacks at every use, as the parent did."""
    if hasattr(layer, "weight_casts"):  # (the parent's layer has none: the test then runs on it unchanged)
        layer.weight_casts.get = lambda name, w, dtype: w.to(dtype)
        layer.weight_casts.stage = lambda dtype, weights: None  # a compiled unit then casts in its graph
    return layer


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.phase = [], "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((self.phase, str(func.overloadpacket), args, out))
        return out

    def count(self, phase, *names):
        return sum(1 for p, name, _, _ in self.ops if p == phase and name.split(".")[-1] in names)


def make_layer(d=32, E=8, K=2, impl="grouped", hidden=32, **cfg):
    torch.manual_seed(0)
    layer = MoELayer(d, MoEConfig(n_experts=E, top_k=K, impl=impl, expert_hidden=hidden, **cfg))
    with torch.no_grad():
        layer.w_out.normal_(0.0, hidden ** -0.5)
    return layer


def run(layer, x, dtype, g_seed=1):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y, aux = layer(x)[:2]
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed)).to(y.dtype)
    ((y * g).float().sum() + aux).backward()
    return [y, aux, x.grad] + [p.grad for p in layer.parameters()]


# ---------------------------------------------------------------------------------------------------------------
# permute_rows
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("repeat", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_rows_equals_indexing_both_ways(repeat, dtype):
    N, D = 13, 8
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(N * repeat, generator=gen)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(N * repeat)) and torch.equal(inverse[order], order[inverse])
    g = torch.randn(N * repeat, D, generator=gen).to(dtype)
    for fn in (permute_rows, indexed_rows):
        x = torch.randn(N, D, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
        y = fn(x, order, inverse, repeat=repeat)
        y.backward(g)
        if fn is permute_rows:
            want = (y, x.grad)
        else:
            assert torch.equal(want[0], y) and torch.equal(want[1], x.grad)
    # and the unsort: a gather by the inverse whose backward gathers by the order
    y = torch.randn(N * repeat, D, generator=gen).to(dtype).requires_grad_(True)
    out = permute_rows(y, inverse, order)
    out.backward(g)
    assert torch.equal(out, y.detach()[inverse]) and torch.equal(y.grad, g[order])


def test_permute_rows_partial_kept_rows():
    """A capacity keeps R of the S slots: the kept rows both ways, a dropped slot reads 0 and sends nothing."""
    S, D, K, R = 12, 4, 2, 7
    gen = torch.Generator().manual_seed(0)
    slot_R = torch.randperm(S, generator=gen)[:R]
    row_S = torch.full((S,), R).scatter_(0, slot_R, torch.arange(R))
    x = torch.randn(S // K, D, generator=gen, requires_grad=True)
    g = torch.randn(R, D, generator=gen)
    permute_rows(x, slot_R, row_S, repeat=K, partial="out").backward(g)
    x_ref = x.detach().clone().requires_grad_(True)
    indexed_rows(x_ref, slot_R, row_S, repeat=K).backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    y = torch.randn(R, D, generator=gen, requires_grad=True)
    out = permute_rows(y, row_S, slot_R, partial="in")
    out.backward(torch.ones(S, D))
    dropped = row_S == R
    assert torch.equal(out[~dropped], y.detach()[row_S[~dropped]]) and not out[dropped].any()
    assert torch.equal(y.grad, torch.ones(R, D))


# ---------------------------------------------------------------------------------------------------------------
# The layer: equal to the parent's indexing and casts, every option
# ---------------------------------------------------------------------------------------------------------------
LAYER_VARIANTS = {
    "top1": dict(K=1), "top2": dict(K=2), "top3": dict(K=3),
    "capacity": dict(K=2, capacity_factor=1.0), "capacity-top1": dict(K=1, capacity_factor=0.75),
    "sequence": dict(K=2, lb_granularity="sequence"), "global": dict(K=2, lb_granularity="global_batch"),
    "bias": dict(K=2, expert_bias=True), "loop": dict(K=2, impl="loop"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
def test_layer_equals_indexing_and_uncached_casts(variant, dtype, monkeypatch):
    layer = make_layer(**LAYER_VARIANTS[variant])
    if layer.expert_bias is not None:
        layer.expert_bias.copy_(torch.linspace(-0.2, 0.2, layer.n_experts))
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2))
    parent = uncached(copy.deepcopy(layer))
    new = run(layer, x, dtype)
    if "capacity" in variant:
        assert int(layer.last_stats["dropped_slots"]) > 0
    monkeypatch.setattr(moe_module, "permute_rows", indexed_rows)
    old = run(parent, x, dtype)
    for a, b in zip(new, old):
        assert (a is None) == (b is None)
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b))


@pytest.mark.parametrize("impl,variant", [("gather", "capacity"), ("static", "capacity"), ("static", "bias")])
def test_mod_model_equals_indexing(impl, variant, monkeypatch):
    """MoD's both implementations (top-4 MoE of the r40 layout): loss, aux loss, every gradient bitwise."""
    extra = {"default": {}, "capacity": {"model.moe.capacity_factor": 1.0},
             "sequence": {"model.moe.lb_granularity": "sequence"}, "bias": {"model.moe.expert_bias": "true"}}
    model = dialled(r40_small(impl, **extra[variant]), 0.3)
    twin = copy.deepcopy(model)  # before the spies (a deep copy would share the first spy's closure)
    with_edge_rows(model), with_edge_rows(twin)
    idx, targets = batch(1)
    a = step(model, idx, targets)
    for block in twin.blocks:
        uncached(block.ffn)
    monkeypatch.setattr(moe_module, "permute_rows", indexed_rows)
    b = step(twin, idx, targets)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.aux_loss, b.aux_loss)
    for (name, pa), (_, pb) in zip(model.named_parameters(), twin.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        assert pa.grad is None or torch.equal(pa.grad, pb.grad), name


# ---------------------------------------------------------------------------------------------------------------
# What runs: no index_put into a zero buffer in the backward; one weight cast per write
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["top2", "top1", "capacity"])
def test_backward_has_no_scatter_into_zeros(variant):
    """The MoE backward is gathers only: no index_put / index_add / index_copy, and no zero-filled (N, K, D) or
    (S, D) buffer (the parent: index_put into a fresh zero buffer per gather, 2 per layer)."""
    layer = make_layer(**LAYER_VARIANTS[variant])
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y, aux = layer(x)
    with OpCount() as ops:
        ops.phase = "backward"
        ((y * y).sum() + aux).backward()
    N, K, D = 30, layer.top_k, 32
    assert ops.count("backward", "index_put", "index_put_", "index_add", "index_add_", "index_copy",
                     "index_copy_", "_index_put_impl_") == 0
    big_zeros = [name for p, name, _, out in ops.ops
                 if "zero" in name and isinstance(out, torch.Tensor) and out.numel() >= N * K * D]
    assert big_zeros == []


def test_weights_cast_once_per_write():
    """bf16 autocast, activation checkpointing, 2 micro-steps: the parent casts each fp32 stack 4 times (2
    forwards + 2 recomputes), now once; a write (optimizer step, load_state_dict, in-place init) recasts.
    Losses and gradients equal the uncached path's bitwise."""
    layer = make_layer(K=2)
    parent = uncached(copy.deepcopy(layer))
    xs = [torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def micro_steps(m, ops=None):
        m.zero_grad(set_to_none=True)
        losses = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, aux = checkpoint(m, x, use_reentrant=False)
            loss = (y.float() ** 2).mean() + aux
            loss.backward()
            losses.append(loss.detach())
        return losses, [p.grad.clone() for p in m.parameters()]

    def weight_casts(ops, m):
        return sum(1 for _, name, args, out in ops.ops if name.endswith("_to_copy")
                   and any(args[0].data_ptr() == p.data_ptr() for p in (m.w_in, m.w_out))
                   and out.dtype == torch.bfloat16)

    def same(a, b):
        assert all(torch.equal(u, v) for u, v in zip(a[0] + a[1], b[0] + b[1]))

    with OpCount() as ops_new:
        new = micro_steps(layer)
    with OpCount() as ops_old:
        old = micro_steps(parent)
    same(new, old)
    assert weight_casts(ops_old, parent) == 2 * 2 * 2  # 2 weights x 2 micro-steps x (forward + recompute)
    assert weight_casts(ops_new, layer) == 2

    writes = [lambda m: [p.add_(p.grad, alpha=-0.1) for p in m.parameters()],  # an optimizer step
              lambda m: m.load_state_dict(make_layer(K=2).state_dict() | {"w_in": m.w_in * 0.5}),
              lambda m: (torch.manual_seed(5), m.reset_parameters())]  # unseeded init: the global RNG
    for i, write in enumerate(writes):
        with torch.no_grad():
            write(layer), write(parent)
        with OpCount() as ops_new:
            new = micro_steps(layer)
        same(new, micro_steps(parent))  # not stale: the written values
        assert weight_casts(ops_new, layer) == 2, i  # recast after the write, then reused
    assert "weight_casts" not in str(layer.state_dict().keys())


def test_inference_mode_leaves_no_inference_tensor_in_the_cache():
    """A cast made under inference_mode is an inference tensor, which a training forward cannot save for its
    backward: such a cast is not cached (the next training step runs and equals the uncached path)."""
    layer = make_layer(K=2)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(2, 8, 32))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    got, want = run(layer, x, torch.bfloat16), run(uncached(copy.deepcopy(layer)), x, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("accum", [1, 2])
def test_a_fused_optimizer_step_is_seen(accum):
    """torch's fused AdamW writes the parameters without bumping `_version`: the cast still follows it, because the
    trainer's zero_grad(set_to_none=True) after the step empties a `.grad` that a gradient was sent to."""
    layer = make_layer(K=2)
    twin = uncached(copy.deepcopy(layer))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, fused=True) for m in (layer, twin)]
    version = layer.w_in._version
    for step in range(3):
        for m, opt in zip((layer, twin), opts):
            for i in range(accum):
                x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(10 * step + i))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y, aux = m(x)
                ((y.float() ** 2).mean() + aux).backward()
            if m is layer:
                grads = [p.grad.clone() for p in m.parameters()]
            else:
                assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters())), step
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert layer.w_in._version == version  # the kernel's writes are invisible to _version
    assert layer.weight_casts.casts == 2 * 3  # once per weight per optimizer step


def test_a_parameter_in_a_flat_buffer_is_not_cached():
    """DeepSpeed ZeRO-1/2 (and FSDP) make parameters views into one flat buffer and write the buffer, which does
    not bump the parameter's `_version`: such a parameter is cast at every use, so a write is always seen."""
    layer, twin = make_layer(K=2), make_layer(K=2)
    flat = torch.cat([layer.w_in.detach().reshape(-1), layer.w_out.detach().reshape(-1)])
    layer.w_in.data = flat[:layer.w_in.numel()].view_as(layer.w_in)
    layer.w_out.data = flat[layer.w_in.numel():].view_as(layer.w_out)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    run(layer, x, torch.bfloat16)
    flat.mul_(0.5)  # the engine's update, through the buffer
    twin.load_state_dict(layer.state_dict())
    got, want = run(layer, x, torch.bfloat16), run(uncached(twin), x, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert layer.weight_casts.casts == 0


def test_cpu_fp32_path_has_no_cast():
    """CPU fp32 (the demo): `.to(fp32)` was a no-op and stays one: no cast, nothing cached."""
    layer = make_layer(K=2)
    with OpCount() as ops:
        run(layer, torch.randn(2, 8, 32), torch.float32)
    float_casts = [args[0].shape for _, name, args, _ in ops.ops
                   if name.endswith("_to_copy") and args[0].is_floating_point()]
    assert float_casts == [] and layer.weight_casts.casts == 0


def test_compiled_checkpointed_unit_takes_the_staged_casts():
    """The compiled MoE unit (train.compile, aot_eager: autograd traced as under inductor) with activation
    checkpointing, bf16 autocast, 2 micro-steps x 3 optimizer steps: the stacks are cast once per optimizer
    step outside the graph and passed in (a new copy per step does not recompile); losses and gradients equal
    the graph that casts inside itself (the parent's), bitwise: the same ops on the same bf16 values."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from nagmoe.train.speed import compile_model, enable_activation_checkpointing

    torch._dynamo.reset()
    counters.clear()
    traced = []

    def backend(gm, inputs):  # dynamo's graphs, then aot_eager
        traced.append(gm)
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, inputs)

    layers = [make_layer(K=2), uncached(make_layer(K=2))]
    for layer in layers:
        holder = SimpleNamespace(sublayers=lambda layer=layer: [layer])
        compile_model(holder, backend=backend), enable_activation_checkpointing(holder)
    xs = [torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    graphs = []
    for step in range(3):
        results = []
        for layer in layers:
            layer.zero_grad(set_to_none=True)
            losses = []
            for x in xs[2 * step:2 * step + 2]:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y, aux = layer(x)
                loss = (y.float() ** 2).mean() + aux
                loss.backward()
                losses.append(loss.detach())
            results.append(losses + [p.grad.clone() for p in layer.parameters()])
            with torch.no_grad():
                for p in layer.parameters():
                    p.add_(p.grad, alpha=-0.5)  # an optimizer step: the next one must recast
        assert all(torch.equal(a, b) for a, b in zip(*results)), step
        graphs.append(counters["stats"]["unique_graphs"])
        assert layers[0].weight_casts.casts == 2 * (step + 1)  # once per weight per optimizer step
    assert graphs[1:] == [graphs[0]] * 2, graphs  # no recompile for a new copy

    def casts_weights(gm):  # a `.to` of a parameter placeholder in the graph
        return any(n.op in ("call_method", "call_function") and str(n.target).endswith("to")
                   and any(str(a).endswith(("w_in_", "w_out_")) and "staged" not in str(a) for a in n.args[:1])
                   for n in gm.graph.nodes)

    def reads_staged(gm):
        return any(n.op == "placeholder" and "staged_casts" in n.name for n in gm.graph.nodes)

    # two graphs: the parent's (casts inside) and the staged one (no cast inside)
    assert sorted((casts_weights(gm), reads_staged(gm)) for gm in traced) == [(False, True), (True, False)]
