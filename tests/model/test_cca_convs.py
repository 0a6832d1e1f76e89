"""CCA's convolutions as shifts + einsum (issue 60, item 4; nagmoe/ops/causal_conv.py): equal to the nn.Conv1d path
in the forward and in every gradient (input, conv weights and biases) for kernels 1-3 and several head counts,
with the decoding cache (chunked prefill, then tokens; its (B, C, W) layout and contents unchanged), under bf16
autocast, and inside the compiled attention unit, whose graph then holds no convolution and has no break.

fp32 tolerance: relative 1e-6 of the largest value, not bitwise: the conv kernels sum the (in-channel, tap)
products in their own order, the einsum/shift path in another (each a few fp32 roundings of ~6e-8)."""
from __future__ import annotations

import pytest
import torch

from nagmoe.config import AttentionConfig
from nagmoe.model.attention import AttentionCache
from nagmoe.model.cca import CCAttention
from tiny_models import tiny_model

D = 32
# (H, K, S) = (n_heads / q_compression, n_heads / kv_compression, head_dim or D / n_heads)
GEOMETRIES = {
    "cca-2x2": dict(n_heads=4, q_compression=2, kv_compression=2),  # H = K = 2, S = 8
    "ccgqa-4x2": dict(n_heads=8, head_dim=8, q_compression=2, kv_compression=4),  # H = 4, K = 2
    "ccgqa-4x1": dict(n_heads=8, head_dim=4, q_compression=2, kv_compression=8),  # H = 4, K = 1
}
KERNELS = [(k1, k2) for k1 in (1, 2, 3) for k2 in (1, 2, 3)]
REL = 1e-6


def _cca(geometry="ccgqa-4x2", k1=2, k2=2, seed=0):
    torch.manual_seed(seed)
    attn = CCAttention(D, AttentionConfig(kind="cca", conv_kernel_1=k1, conv_kernel_2=k2, **GEOMETRIES[geometry]))
    with torch.no_grad():  # zero-init c_proj would make the module's output trivially equal
        attn.c_proj.weight.normal_(std=D ** -0.5)
    return attn


def _rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _convs_and_grads(attn, impl, qk_BTC, g_BTC):
    """`_convs` of `impl` and the gradients of <y, g> by the input and the four conv parameters."""
    attn.conv_impl = impl
    attn.zero_grad()
    x = qk_BTC.clone().requires_grad_(True)
    y = attn._convs(x, None)
    (y * g_BTC).sum().backward()
    params = {n: p.grad.clone() for n, p in attn.named_parameters() if n.startswith("conv_")}
    return y.detach(), {"input": x.grad, **params}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("k1,k2", KERNELS)
def test_shift_equals_conv_forward_and_every_gradient(geometry, k1, k2):
    attn = _cca(geometry, k1, k2)
    qk_BTC, g_BTC = _rand(2, 9, attn.channels), _rand(2, 9, attn.channels, seed=2)
    y_conv, grads_conv = _convs_and_grads(attn, "conv", qk_BTC, g_BTC)
    y_shift, grads_shift = _convs_and_grads(attn, "shift", qk_BTC, g_BTC)
    assert y_shift.shape == y_conv.shape and y_shift.is_contiguous()
    assert _rel(y_shift, y_conv) <= REL
    assert sorted(grads_shift) == ["conv_head.bias", "conv_head.weight", "conv_seq.bias", "conv_seq.weight", "input"]
    for name in grads_conv:
        assert grads_shift[name].shape == grads_conv[name].shape
        assert _rel(grads_shift[name], grads_conv[name]) <= REL, name


def _decode(attn, impl, x_BTD, chunks, grad=False):
    """The module over `x_BTD` in chunks through one AttentionCache: the outputs and the conv cache after each."""
    attn.conv_impl = impl
    cache, ys, states = AttentionCache(x_BTD.shape[1]), [], []
    start = 0
    with torch.set_grad_enabled(grad):
        for n in chunks:
            ys.append(attn(x_BTD[:, start:start + n], cache=cache)[0])
            states.append(cache.conv_BCW)
            start += n
    return torch.cat(ys, dim=1), states


@pytest.mark.parametrize("geometry,k1,k2", [("cca-2x2", 2, 2), ("ccgqa-4x2", 3, 3), ("ccgqa-4x1", 1, 3),
                                            ("ccgqa-4x2", 1, 1)])
def test_chunked_prefill_then_tokens_equal_the_full_forward_and_keep_the_cache(geometry, k1, k2):
    """Shift path through the cache (prefill 5, 3, then single tokens) = the conv path's full forward; the conv
    cache holds the same raw tokens in the same (B, C, W) contiguous layout as the conv path's (bitwise: both
    copy the same c_q/c_k outputs)."""
    attn = _cca(geometry, k1, k2)
    x_BTD = _rand(2, 11, D)
    attn.conv_impl = "conv"
    with torch.no_grad():
        full = attn(x_BTD)[0]
    chunks = (5, 3, 1, 1, 1)
    y_shift, states_shift = _decode(attn, "shift", x_BTD, chunks)
    y_conv, states_conv = _decode(attn, "conv", x_BTD, chunks)
    assert _rel(y_shift, full) <= 1e-5  # + attention over the cached keys (test_kv_cache's tolerance)
    assert _rel(y_shift, y_conv) <= 1e-5
    W = attn.conv_history
    for s, c in zip(states_shift, states_conv):
        assert s.shape == c.shape == (2, attn.channels, W) and s.is_contiguous() and c.is_contiguous()
        torch.testing.assert_close(s, c, atol=0, rtol=0)


def test_bf16_autocast_error_no_larger_than_the_conv_paths():
    """Under CPU bf16 autocast both paths return bf16; the shift path's distance to the fp32 result is at most
    the conv path's (x2 and a bf16 ulp of slack: they round at different places), forward and input gradient."""
    attn = _cca("ccgqa-4x2", 2, 2)
    x_BTD, g_BTD = _rand(2, 12, D), _rand(2, 12, D, seed=3)

    def run(impl, autocast):
        attn.conv_impl = impl
        x = x_BTD.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            qk = attn._convs(torch.cat([attn.c_q(x), attn.c_k(x)], dim=-1), None)
            y = attn(x)[0]
        (y.float() * g_BTD).sum().backward()
        return qk, y, x.grad

    qk_ref, y_ref, gx_ref = run("conv", False)
    qk_conv, y_conv, gx_conv = run("conv", True)
    qk_shift, y_shift, gx_shift = run("shift", True)
    assert qk_conv.dtype == qk_shift.dtype == torch.bfloat16
    for shift, conv, ref in ((qk_shift, qk_conv, qk_ref), (y_shift, y_conv, y_ref), (gx_shift, gx_conv, gx_ref)):
        assert _rel(shift, ref) <= 2 * _rel(conv, ref) + 2 ** -8, (_rel(shift, ref), _rel(conv, ref))


# ------------------------------------------------------------------------------------------------------------
# Inside the compiled unit (aot_autograd with a recording backend: the aten graphs inductor would get)
# ------------------------------------------------------------------------------------------------------------
class GraphRecorder:
    """A torch.compile backend that runs the aot-traced graphs eagerly and keeps them: `fw`, `bw` lists of the
    forward and backward aten graphs, one forward per dynamo graph (a graph break adds one)."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        self.fw, self.bw = [], []

        def keep(graphs):
            def compiler(gm, _inputs):
                graphs.append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw))

    @staticmethod
    def count(graphs, op_name: str) -> int:
        return sum(1 for gm in graphs for n in gm.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith(op_name))


def _unit_grads(attn, x_BTD, g_BTD):
    attn.zero_grad()
    x = x_BTD.clone().requires_grad_(True)
    y = attn(x)[0]
    (y.float() * g_BTD).sum().backward()
    return y.detach(), {"input": x.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_compiled_attention_unit_has_no_convolution_and_equals_eager(autocast):
    """The attention sublayer of a tiny CCGQA model (k1 = 3, k2 = 2) compiled as the trainer compiles it
    (speed.compile_model: the class forward is the unit): one forward graph (the convs add no break), no
    aten.convolution in it and none in its backward; its output and every gradient (input, conv weights and
    biases, projections) equal the eager conv path's (fp32: 1e-6 relative; bf16: no further from the fp32
    result than the eager conv path under autocast, x2 and a bf16 ulp)."""
    import copy

    from nagmoe.train.speed import compile_model

    torch._dynamo.reset()
    cca = dict(kind="cca", n_heads=8, head_dim=8, q_compression=2, kv_compression=4, conv_kernel_1=3,
               conv_kernel_2=2)
    model = tiny_model(attention=cca)
    attn = next(s for s in model.sublayers() if isinstance(s, CCAttention))
    eager = copy.deepcopy(attn)
    eager.conv_impl = "conv"
    recorder = GraphRecorder()
    compile_model(model, backend=recorder.backend)
    x_BTD, g_BTD = _rand(2, 16, D), _rand(2, 16, D, seed=2)
    y_fp32, grads_fp32 = _unit_grads(eager, x_BTD, g_BTD)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y_ref, grads_ref = _unit_grads(eager, x_BTD, g_BTD)
        y, grads = _unit_grads(attn, x_BTD, g_BTD)
    n_fw, n_bw = (recorder.count(graphs, "aten.convolution") for graphs in (recorder.fw, recorder.bw))
    print(f"\nattention unit: {len(recorder.fw)} forward graph(s), aten.convolution* {n_fw} forward, {n_bw} backward")
    assert len(recorder.fw) == len(recorder.bw) == 1  # the unit is one graph: no break
    assert n_fw == 0 and n_bw == 0  # aten.convolution and aten.convolution_backward
    assert grads.keys() == grads_ref.keys() and {"conv_seq.weight", "conv_head.bias"} <= grads.keys()
    for name, a, b in [("output", y, y_ref)] + [(n, grads[n], grads_ref[n]) for n in grads_ref]:
        if autocast:  # bf16 outputs differ by an ulp where they round differently: measured against fp32
            ref = y_fp32 if name == "output" else grads_fp32[name]
            assert _rel(a, ref) <= 2 * _rel(b, ref) + 2 ** -8, (name, _rel(a, ref), _rel(b, ref))
        else:
            assert _rel(a, b) <= REL, name


def test_compiled_decoding_with_cache_equals_eager_conv_path():
    """The module compiled (auto: the shift path inside the graph) over a cache, prefill then tokens, equals the
    eager conv path with the same cache, outputs and conv state, with no convolution in any graph."""
    torch._dynamo.reset()
    attn = _cca("ccgqa-4x1", 2, 3)
    x_BTD = _rand(1, 8, D)  # B = T = 1 in the token steps: where traced and real layouts can disagree
    recorder = GraphRecorder()
    step = torch.compile(lambda x, cache: attn(x, cache=cache)[0], backend=recorder.backend, dynamic=False)
    attn.conv_impl = "auto"
    cache, ys, start = AttentionCache(8), [], 0
    with torch.no_grad():
        for n in (6, 1, 1):
            ys.append(step(x_BTD[:, start:start + n], cache))
            start += n
    y_conv, states_conv = _decode(attn, "conv", x_BTD, (6, 1, 1))
    assert recorder.fw and recorder.count(recorder.fw, "aten.convolution") == 0
    assert _rel(torch.cat(ys, dim=1), y_conv) <= 1e-5
    torch.testing.assert_close(cache.conv_BCW, states_conv[-1], atol=0, rtol=0)
    assert cache.conv_BCW.is_contiguous()


def test_eager_auto_runs_the_conv_ops():
    """Eagerly `auto` is the conv path (the CPU eager numbers of make demo do not move): bitwise equal to it."""
    attn = _cca("cca-2x2", 2, 2)
    x_BTD = _rand(2, 8, D)
    attn.conv_impl = "conv"
    ref = attn(x_BTD)[0]
    attn.conv_impl = "auto"
    torch.testing.assert_close(attn(x_BTD)[0], ref, atol=0, rtol=0)
