"""Benchmark: CCA vs MHA attention sublayer — forward+backward time and KV-cache bytes per token, as ratios
measured side by side in one process, written as JSON.

    python tools/bench/bench_cca.py                             # paper width (configs/paper/nag-r40.yaml), seq 2048
    python tools/bench/bench_cca.py --config configs/tiny.yaml --seq-len 256 --iters 5 --out bench_cca.json

The CCA module is the config's attention (`model.attention`, kind cca); the MHA baseline is the same width
with `n_heads` full heads (kind mha, no GQA). Each iteration times one forward and one forward+backward of
one sublayer on a (batch, seq, d_model) input, alternating the variants so that machine load hits both
alike; the minimum (least disturbed by other load) and the median are reported, ratios from the minima. KV bytes per token are read from a real `AttentionCache` after a short
prefill (fp32 here; bf16 halves both). CCA's conv and value-shift state is a per-sequence constant, reported
separately. This is plain PyTorch (unfused convs, SDPA), not the paper's fused kernel.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from nagmoe.config import load_config  # noqa: E402
from nagmoe.flops import forward_flops_per_token, param_counts  # noqa: E402
from nagmoe.model.attention import AttentionCache, build_attention  # noqa: E402
from bench_output import emit_json  # noqa: E402  (tools/bench/)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variants(model_cfg):
    cca = copy.deepcopy(model_cfg)
    cca.attention.kind = "cca"
    mha = copy.deepcopy(model_cfg)
    mha.attention.kind, mha.attention.n_kv_heads = "mha", None
    return {"mha": mha, "cca": cca}


def _time(fn, device=torch.device("cpu")) -> float:
    """Seconds of fn(); on CUDA the queued kernels are waited for on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def bench(config_path: str, seq_len: int, batch: int, iters: int, warmup: int, seed: int = 0,
          device: str = "cpu") -> dict:
    """`device` cuda: the modules and input there, the forward under bf16 autocast (as training runs it)."""
    cfg = load_config(config_path)
    variants = _variants(cfg.model)
    d = cfg.model.d_model
    dev = torch.device(device)
    torch.manual_seed(seed)
    modules = {name: build_attention(d, m.attention, m.init_std).to(dev) for name, m in variants.items()}
    x = torch.randn(batch, seq_len, d).to(dev)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def fwd(module):
        with torch.no_grad(), autocast():
            module(x)

    def fwd_bwd(module):
        xg = x.detach().requires_grad_(True)
        with autocast():
            loss = module(xg)[0].float().square().mean()
        loss.backward()
        module.zero_grad(set_to_none=True)

    times = {name: {"forward_s": [], "forward_backward_s": []} for name in modules}
    for i in range(warmup + iters):
        for name, module in modules.items():  # alternate: load drifts hit both variants
            f, fb = _time(lambda: fwd(module), dev), _time(lambda: fwd_bwd(module), dev)
            if i >= warmup:
                times[name]["forward_s"].append(f)
                times[name]["forward_backward_s"].append(fb)

    out = {}
    for name, module in modules.items():
        cache = AttentionCache(16)
        with torch.no_grad():
            module(x[:1, :16], cache=cache)
        m = variants[name]
        flops = forward_flops_per_token(m, seq_len)
        layers = m.n_layers
        out[name] = {
            "query_heads": module.n_heads, "kv_heads": module.n_kv_heads, "head_dim": module.head_dim,
            "params": sum(p.numel() for p in module.parameters()),
            "params_check": param_counts(m)["attention"] // layers,
            "forward_flops_per_token": (flops["attention_proj"] + flops["attention_conv"]
                                        + flops["attention_scores"]) / layers,
            "forward_s": min(times[name]["forward_s"]),
            "forward_backward_s": min(times[name]["forward_backward_s"]),
            "forward_s_median": statistics.median(times[name]["forward_s"]),
            "forward_backward_s_median": statistics.median(times[name]["forward_backward_s"]),
            "kv_cache_bytes_per_token_fp32": cache.kv_bytes_per_token(),
            "fixed_state_bytes_per_sequence_fp32": cache.state_bytes(),
        }
    m, c = out["mha"], out["cca"]
    ratios = {key: c[key] / m[key] for key in ("params", "forward_flops_per_token", "forward_s",
                                                 "forward_backward_s", "forward_backward_s_median",
                                                 "kv_cache_bytes_per_token_fp32")}
    return {
        "benchmark": "cca_vs_mha_attention_sublayer",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "config": os.path.relpath(config_path, REPO) if config_path.startswith(REPO) else config_path,
        "d_model": d, "seq_len": seq_len, "batch": batch, "iters": iters, "warmup": warmup,
        "attention": {k: getattr(cfg.model.attention, k) for k in (
            "n_heads", "q_compression", "kv_compression", "conv_kernel_1", "conv_kernel_2", "use_convs",
            "use_qk_mean", "use_value_shift", "impl")},
        "variants": out,
        "cca_over_mha": ratios,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs/paper/nag-r40.yaml"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench(args.config, args.seq_len, args.batch, args.iters, args.warmup)
    emit_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
