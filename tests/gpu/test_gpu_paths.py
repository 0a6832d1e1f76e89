"""CUDA fast paths against their references (run by tools/gpu_check/gpu_check.sh). Imports nothing that needs datasets,
wandb or deepspeed (the GPU machine has none of them).

Tests of a real CUDA kernel skip without a CUDA device. The fused-NAG comparison also runs on the CPU stand-in
(CPU bf16 autocast under CUDA's rules, NAGMOE_CUDA_RULES: nagmoe/cuda_rules/tier.py), as training runs it."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch

from nagmoe.ops.grouped_experts import experts_grouped, experts_loop
from nagmoe.ops.nag_fused import NAGOps, resolve_nag_backend
from nagmoe.train.precision_context import TrainingPrecision

HERE = os.path.dirname(os.path.abspath(__file__))
NO_CUDA = "needs a CUDA device: a real CUDA kernel (tools/gpu_check/gpu_check.sh runs it)"


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)(test))


F32, BF16 = torch.float32, torch.bfloat16
# The stream lanes as training hands them to the NAG op (nagmoe/model/residual.py): fp32 gate weights always;
# under bf16 autocast the branch output is bf16 and the direction fp32 (train.precision=uniform) or bf16
# (legacy). (case, direction dtype, branch dtype, autocast, tolerance)
NAG_CASES = [("float32", F32, F32, False, 1e-4), ("bf16-uniform", F32, BF16, True, 2e-2),
             ("bf16-legacy", BF16, BF16, True, 2e-2)]


def _nag_inputs(direction_dtype, branch_dtype, device, B=4, T=256, D=1024, C=32):
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(B, T, D, generator=gen)
    direction = direction * torch.rsqrt(direction.pow(2).mean(-1, keepdim=True))
    tensors = dict(log_norm=torch.randn(B, T, generator=gen), direction=direction.to(direction_dtype),
                   branch=torch.randn(B, T, D, generator=gen).to(branch_dtype),
                   weight=torch.randn(C, D, generator=gen) * D ** -0.5, bias=torch.zeros(C),
                   coef=torch.randn(C, generator=gen), beta_raw=torch.tensor(0.5), alpha=torch.tensor(0.5))
    return {k: v.to(device).requires_grad_(True) for k, v in tensors.items()}


def _precision(device, autocast):
    """The trainer's precision context: CUDA bf16 autocast, or on the CPU bf16 under CUDA's rules of 2.11."""
    return TrainingPrecision(device, environ={"NAGMOE_CUDA_RULES": "2.11"}) if autocast else None


def _gated_update(ops, x, device, precision):
    args = (x["log_norm"], x["direction"], x["branch"], x["weight"], x["bias"], x["coef"], x["beta_raw"],
            x["alpha"], torch.tensor(1.0, device=device), 1e-6, 1e-6)
    if precision is None:
        return ops.gated_update(*args)
    with precision.scope(), precision.autocast():  # the forward's region; the backward runs outside it
        return ops.gated_update(*args)


def _compare_fused_with_eager(device, direction_dtype, branch_dtype, autocast, tol):
    x = _nag_inputs(direction_dtype, branch_dtype, device)
    precision = _precision(device, autocast)
    results = {}
    for name in ("eager", "compiled"):
        out = _gated_update(NAGOps(name), x, device, precision)
        gen = torch.Generator(device=device).manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, device=device, generator=gen)).sum() for o in out)
        with precision.scope() if precision is not None else nullcontext():  # the trainer's backward
            results[name] = (out, torch.autograd.grad(loss, list(x.values())))
    for e, f in zip(results["eager"][0], results["compiled"][0]):
        assert e.dtype == f.dtype
        torch.testing.assert_close(f.float(), e.float(), rtol=tol, atol=tol)
    for e, f in zip(results["eager"][1], results["compiled"][1]):
        torch.testing.assert_close(f.float(), e.float(), rtol=tol, atol=tol * 10)


@needs_cuda
@pytest.mark.parametrize("case,direction_dtype,branch_dtype,autocast,tol", NAG_CASES, ids=[c[0] for c in NAG_CASES])
def test_fused_nag_matches_eager_on_cuda(case, direction_dtype, branch_dtype, autocast, tol):
    assert resolve_nag_backend("auto", "cuda") == "compiled"
    _compare_fused_with_eager("cuda", direction_dtype, branch_dtype, autocast, tol)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the CUDA case runs instead")
@pytest.mark.skipif(resolve_nag_backend("compiled") != "compiled", reason="no C++ compiler for inductor")
@pytest.mark.parametrize("case,direction_dtype,branch_dtype,autocast,tol", NAG_CASES[1:],
                         ids=[c[0] for c in NAG_CASES[1:]])
def test_fused_nag_matches_eager_on_the_cpu_stand_in(case, direction_dtype, branch_dtype, autocast, tol):
    """The bf16 cases on the CPU under CUDA's autocast rules (a cold inductor C++ compile, ~30 s), in a fresh
    process: after ~230 earlier tests of the suite had registered and destroyed the rules' AutocastCPU library
    in the same process, the compiled graph's addmm crashed the whole run (SIGABRT "corrupted size vs.
    prev_size", or SIGSEGV, at the same call; docs/decisions.md, issue 50's CI failure). Alone it never did."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from test_gpu_paths import NAG_CASES, "
            f"_compare_fused_with_eager; c = {{x[0]: x for x in NAG_CASES}}[{case!r}]; "
            "_compare_fused_with_eager('cpu', *c[1:])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]


def test_bf16_nag_inputs_need_the_autocast_training_runs_under():
    """Issue 52 item 4: bf16 lanes with the fp32 gate weights and no autocast (the old test's setup) fail in the
    modulator's F.linear, on CUDA and on the CPU alike; under the trainer's autocast (here its CPU stand-in) the
    linear runs in bf16 and the op returns the training dtypes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _nag_inputs(BF16, BF16, device)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        _gated_update(NAGOps("eager"), x, device, None)
    for direction_dtype in (F32, BF16):  # uniform, legacy
        x = _nag_inputs(direction_dtype, BF16, device)
        log_norm, direction, m, scale = _gated_update(NAGOps("eager"), x, device, _precision(device, True))
        assert (log_norm.dtype, direction.dtype, m.dtype, scale.dtype) == (F32, direction_dtype, F32, F32)
        assert torch.isfinite(direction.float()).all() and ((m >= 0) & (m <= 1)).all()


@needs_cuda
@pytest.mark.parametrize("n_experts", [8, 64])
def test_grouped_bf16_matches_loop_on_cuda(n_experts):
    gen = torch.Generator().manual_seed(n_experts)
    S, D, H = 4096, 512, 1024
    counts = torch.bincount(torch.randint(0, n_experts, (S,), generator=gen), minlength=n_experts).cuda()
    x = torch.randn(S, D, generator=gen).cuda().bfloat16()
    w_in = (torch.randn(n_experts, D, H, generator=gen) * D ** -0.5).cuda().bfloat16()
    w_out = (torch.randn(n_experts, H, D, generator=gen) * H ** -0.5).cuda().bfloat16()
    g = torch.randn(S, D, generator=gen).cuda().bfloat16()
    grads = {}
    for name, fn in (("grouped", experts_grouped), ("loop", experts_loop)):
        params = [t.clone().requires_grad_(True) for t in (x, w_in, w_out)]
        y = fn(*params, counts)
        y.backward(g)
        grads[name] = (y.float(), *(p.grad.float() for p in params))
    for a, b in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@needs_cuda
def test_model_step_fused_vs_eager_under_bf16_autocast():
    from nagmoe.config import AttentionConfig, ModelConfig, MoEConfig, NAGConfig
    from nagmoe.model import build_model

    losses = {}
    for impl in ("eager", "compiled"):
        torch.manual_seed(0)
        cfg = ModelConfig(residual="nag", vocab_size=512, d_model=256, n_layers=2, max_seq_len=128, ffn="moe",
                          attention=AttentionConfig(n_heads=4), moe=MoEConfig(n_experts=8, top_k=2),
                          nag=NAGConfig(C=8, impl=impl))
        model = build_model(cfg).cuda()
        idx = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(idx, idx)
        (out.loss + out.aux_loss).backward()
        losses[impl] = out.loss.item()
    assert abs(losses["compiled"] - losses["eager"]) < 2e-2 * abs(losses["eager"])


@needs_cuda
def test_flash_attention_matches_math_reference():
    """flash-attn adapter (optional `gpu` extra) against the explicit-matmul reference, GQA and a KV offset."""
    pytest.importorskip("flash_attn", reason="flash-attn is an optional extra, not installed here")
    from nagmoe.model.attention import causal_attention

    gen = torch.Generator().manual_seed(0)
    B, H, K, T, S, offset = 2, 8, 2, 128, 64, 32
    q = torch.randn(B, H, T, S, generator=gen).cuda().bfloat16()
    k = torch.randn(B, K, offset + T, S, generator=gen).cuda().bfloat16()
    v = torch.randn(B, K, offset + T, S, generator=gen).cuda().bfloat16()
    want = causal_attention(q.float(), k.float(), v.float(), "math", q_offset=offset)
    got = causal_attention(q, k, v, "flash", q_offset=offset)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@needs_cuda
def test_batches_reach_the_device_without_a_blocking_copy():
    """Issue 39: the trainer's batch copy (nagmoe/data/host_copy.py) pins and copies non-blocking: the sync
    counter, which counts a pageable `to(cuda)`, sees nothing; the plain copy it does see."""
    from nagmoe.data.host_copy import to_device
    from nagmoe.train.sync_count import SyncCounter

    x = torch.randint(0, 100, (4, 2048))
    with SyncCounter() as counter:
        y = to_device(x, torch.device("cuda"))
    assert counter.total == 0, counter.table()
    torch.cuda.synchronize()
    assert y.device.type == "cuda" and torch.equal(y.cpu(), x)
    with SyncCounter() as counter:
        x.to("cuda")
    assert counter.total == 1, counter.table()
