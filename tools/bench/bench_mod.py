"""Benchmark: Mixture-of-Depths vs full depth on the same model — training tokens/s (forward + backward) side by
side with the executed-FLOP ratio, written as JSON.

    python tools/bench/bench_mod.py                                            # configs/tiny-mod20.yaml, 8 x 256
    python tools/bench/bench_mod.py --config configs/tiny-mod20.yaml --rows 8 --iters 10 --out bench_mod.json
    python tools/bench/bench_mod.py --block [--repeats 7 --inner 3 --rates 0.1,0.2,0.3 --block-rows 1 --profile 2
                                       --allocator caching|jemalloc|default --threads 1 --smoke] [overrides]
                                                                             # bench_mod_block.py
    python tools/bench/bench_mod.py --block --attention-kernels [--repeats 15 --inner 3 --smoke]   # the score kernel

One model, one set of weights: the MoD variant uses thresholds at the config's skip rate, taken from the score
histograms of a calibration forward (`set_mod_skip_rate`, as the generate dial does); the full-depth variant
is the same model with the dial at 0 (every token runs every sublayer, plus the base vectors). Each iteration
times one forward + backward (no optimizer step) of each variant in turn, so machine load hits both alike;
the minimum (least disturbed) and the median are reported, ratios from the minima; process CPU time beside
the wall clock (with --threads 1 it measures the work even when other jobs share the cores). The ideal
speed-up is the executed-FLOP ratio `flops_per_token(executed=1) / flops_per_token(executed=realised)`; the
goal is a wall-clock gain (speed-up - 1) of at least 90% of that FLOP gain. Plain PyTorch on whatever device
runs it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from nagmoe.config import load_config  # noqa: E402
from nagmoe.flops import flops_per_token  # noqa: E402
from nagmoe.model import build_model  # noqa: E402
from bench_output import emit_json  # noqa: E402  (tools/bench/)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step_seconds(model, idx) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward + backward; on CUDA under bf16 autocast (as training runs it),
    the queued kernels waited for on both sides."""
    cuda = idx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(idx.device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        out = model(idx, idx)
    (out.loss + out.aux_loss).backward()
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(idx.device)
    return time.perf_counter() - t0, time.process_time() - c0


# ops whose work the FLOP accounting counts (matmuls, attention, convolutions), forward and backward
COUNTED_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::convolution_backward",
               "aten::mkldnn_convolution", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_scaled_dot_product_attention_math")


def _profile_split(model, idx, steps: int = 3) -> dict:
    """Self CPU seconds per step in the counted ops and in everything else (elementwise NAG math, norms,
    softmax/loss, index moves, allocation)."""
    from torch.profiler import profile

    with profile() as prof:
        for _ in range(steps):
            _step_seconds(model, idx)
    events = prof.key_averages()
    counted = sum(e.self_cpu_time_total for e in events if e.key in COUNTED_OPS) / 1e6 / steps
    total = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    return {"counted_ops_s": counted, "other_s": total - counted}


def bench(config_path: str, rows: int, iters: int, warmup: int, seed: int = 0,
          overrides: tuple = (), profile_steps: int = 0, device: str = "cpu") -> dict:
    cfg = load_config(config_path, list(overrides))
    dev = torch.device(device)
    m, T = cfg.model, cfg.data.seq_len
    if m.mod.skip_rate <= 0:
        raise SystemExit(f"{config_path}: model.mod.skip_rate is 0; pick a MoD config (e.g. configs/tiny-mod20.yaml)")
    torch.manual_seed(seed)
    model = build_model(m).to(dev).train()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, m.vocab_size, (rows, T), generator=gen).to(dev)
    with torch.no_grad():  # calibration: this batch's score histograms
        model(torch.randint(0, m.vocab_size, (rows, T), generator=gen).to(dev))
    model.mod_update()

    def realised_fractions():
        with torch.no_grad():
            return model(idx, collect_stats=True).stats["executed_frac"]

    model.set_mod_skip_rate(m.mod.skip_rate)
    mod_fractions = realised_fractions()
    model.set_mod_skip_rate(0.0)
    assert realised_fractions() == [1.0] * len(mod_fractions)

    times = {"full": [], "mod": []}
    cpu = {"full": [], "mod": []}
    for i in range(warmup + iters):
        for name, rate in (("full", 0.0), ("mod", m.mod.skip_rate)):
            model.set_mod_skip_rate(rate)
            wall, proc = _step_seconds(model, idx)
            if i >= warmup:
                times[name].append(wall)
                cpu[name].append(proc)
    tokens = rows * T
    out = {name: {"step_s": min(ts), "step_s_median": statistics.median(ts), "tokens_per_s": tokens / min(ts),
                  "cpu_s": min(cpu[name]), "cpu_s_median": statistics.median(cpu[name])}
           for name, ts in times.items()}
    split = {}
    if profile_steps:
        for name, rate in (("full", 0.0), ("mod", m.mod.skip_rate)):
            model.set_mod_skip_rate(rate)
            split[name] = _profile_split(model, idx, profile_steps)
    full_flops, mod_flops = flops_per_token(m, T, 1.0), flops_per_token(m, T, mod_fractions)
    speedup = out["full"]["step_s"] / out["mod"]["step_s"]
    flop_ratio = full_flops / mod_flops
    return {
        "benchmark": "mod_vs_full_depth_training_step",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "config": os.path.relpath(config_path, REPO) if config_path.startswith(REPO) else config_path,
        "overrides": list(overrides), "rows": rows, "seq_len": T, "iters": iters, "warmup": warmup,
        "skip_rate_target": m.mod.skip_rate, "executed_fractions": mod_fractions,
        "backends": {"attention": m.attention.impl, "moe": m.moe.impl},
        "flops_per_token": {"full": full_flops, "mod": mod_flops},
        "variants": out,
        "executed_flop_ratio": flop_ratio,
        "wall_clock_speedup": speedup,
        "speedup_median": out["full"]["step_s_median"] / out["mod"]["step_s_median"],
        "gain_fraction_of_flop_gain": (speedup - 1) / (flop_ratio - 1),
        # process CPU time: with --threads 1 it tracks the work done even on a loaded machine
        "cpu_speedup": out["full"]["cpu_s"] / out["mod"]["cpu_s"],
        "cpu_gain_fraction_of_flop_gain": (out["full"]["cpu_s"] / out["mod"]["cpu_s"] - 1) / (flop_ratio - 1),
        # --profile: time in the ops the FLOPs count vs the rest; counted_ops_speedup ~ flop ratio means the
        # skipped work is really skipped, and the "other" share bounds the wall-clock gain
        "profile_split": split or None,
        "counted_ops_speedup": (split["full"]["counted_ops_s"] / split["mod"]["counted_ops_s"]) if split else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs/tiny-mod20.yaml"))
    ap.add_argument("--rows", type=int, default=8, help="sequences per step (seq_len from the config)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write the JSON here (it is always printed)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS steps per variant: time in FLOP-counted ops vs the rest")
    ap.add_argument("--block", action="store_true",
                    help="one block of the r40 paper config at seq 2048, MoD 0/10/20/30%% vs full depth "
                         "(tools/bench/bench_mod_block.py): paired repeats, bootstrap CI, realised share of the "
                         "FLOP gain")
    ap.add_argument("--repeats", type=int, default=7, help="--block: paired repeats")
    ap.add_argument("--inner", type=int, default=3, help="--block: steps per variant and repeat (the fastest kept)")
    ap.add_argument("--rates", default=None, help="--block: comma-separated skip rates (default 0.1,0.2,0.3)")
    ap.add_argument("--allocator", choices=("caching", "jemalloc", "default"), default="caching",
                    help="--block on CPU: glibc keeps freed memory like CUDA's caching allocator (default); "
                         "jemalloc preloaded with its decay off (the command runs again under it: glibc refaults "
                         "the 1 GiB tensors of 16 rows every step); or glibc's defaults (an mmap and page faults "
                         "per large tensor)")
    ap.add_argument("--block-rows", type=int, default=1, help="--block: sequences of seq_len per step")
    ap.add_argument("--smoke", action="store_true", help="--block: tiny dims, 2 repeats (CI, gpu_check --cpu)")
    ap.add_argument("--attention-kernels", action="store_true",
                    help="--block: only the attention score kernel, full causal vs 20%% skipped through the "
                         "blocked SDPA and the chunked CPU kernel (median time ratios)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    if args.block and args.allocator == "jemalloc":
        from bench_mod_block import run_under_jemalloc

        run_under_jemalloc([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])  # returns once it is the malloc
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.block and args.attention_kernels:
        from bench_mod_block import bench_attention_kernels

        result = bench_attention_kernels(rows=args.block_rows, repeats=2 if args.smoke else args.repeats,
                                         inner=1 if args.smoke else args.inner, smoke=args.smoke,
                                         overrides=tuple(args.overrides))
    elif args.block:
        from bench_mod_block import RATES, bench_block

        result = bench_block(repeats=2 if args.smoke else args.repeats, rates=(0.2,) if args.smoke else
                             tuple(float(r) for r in args.rates.split(",")) if args.rates else RATES,
                             smoke=args.smoke, profile=args.profile > 0,
                             profile_steps=max(1, args.profile), inner=1 if args.smoke else args.inner,
                             rows=args.block_rows, overrides=tuple(args.overrides), allocator=args.allocator)
    else:
        result = bench(args.config, args.rows, args.iters, args.warmup, overrides=tuple(args.overrides),
                       profile_steps=args.profile)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
