"""CUDA fast paths against their references (run by tools/gpu_check.sh; skipped without a CUDA device).
Imports nothing that needs datasets, wandb or deepspeed (the GPU machine has none of them)."""
from __future__ import annotations

import pytest
import torch

from nagmoe.ops.grouped_experts import experts_grouped, experts_loop
from nagmoe.ops.nag_fused import NAGOps, resolve_nag_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh)")]


def _nag_inputs(dtype, B=4, T=256, D=1024, C=32):
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(B, T, D, generator=gen)
    direction = direction * torch.rsqrt(direction.pow(2).mean(-1, keepdim=True))
    tensors = dict(log_norm=torch.randn(B, T, generator=gen), direction=direction.to(dtype),
                   branch=torch.randn(B, T, D, generator=gen).to(dtype),
                   weight=torch.randn(C, D, generator=gen) * D ** -0.5, bias=torch.zeros(C),
                   coef=torch.randn(C, generator=gen), beta_raw=torch.tensor(0.5), alpha=torch.tensor(0.5))
    return {k: v.cuda().requires_grad_(True) for k, v in tensors.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fused_nag_matches_eager_on_cuda(dtype, tol):
    assert resolve_nag_backend("auto") == "compiled"
    x = _nag_inputs(dtype)
    warmup = torch.tensor(1.0, device="cuda")
    results = {}
    for name in ("eager", "compiled"):
        ops = NAGOps(name)
        out = ops.gated_update(x["log_norm"], x["direction"], x["branch"], x["weight"], x["bias"], x["coef"],
                               x["beta_raw"], x["alpha"], warmup, 1e-6, 1e-6)
        gen = torch.Generator(device="cuda").manual_seed(1)
        loss = sum((o.float() * torch.randn(o.shape, device="cuda", generator=gen)).sum() for o in out)
        results[name] = (out, torch.autograd.grad(loss, list(x.values())))
    for e, f in zip(results["eager"][0], results["compiled"][0]):
        torch.testing.assert_close(f.float(), e.float(), rtol=tol, atol=tol)
    for e, f in zip(results["eager"][1], results["compiled"][1]):
        torch.testing.assert_close(f.float(), e.float(), rtol=tol, atol=tol * 10)


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


def test_batches_reach_the_device_without_a_blocking_copy():
    """Issue 39: the trainer's batch copy (nagmoe/train/host_copy.py) pins and copies non-blocking: the sync
    counter, which counts a pageable `to(cuda)`, sees nothing; the plain copy it does see."""
    from nagmoe.train.host_copy import to_device
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
