"""Benchmark suite: every performance claim of the project as a ratio measured side by side, written as JSON
(and, with --markdown, as a docs/benchmarks.md section with each goal marked met / not met).

    OMP_NUM_THREADS=1 python tools/bench/bench_suite.py --out bench_suite.json --markdown bench_suite.md
    python tools/bench/bench_suite.py --smoke                       # seconds: tiny sizes, 1 repetition (CI)
    python tools/bench/bench_suite.py --device cuda --paper-width   # on a GPU by hand (the GPU check does not
                                                                    # run it)

Sections (each repetition count excludes the warm-up; min = least disturbed, median beside it; ratios from
the minima):
  nag       training step (forward + backward, no optimizer) of the same model with the pre-norm stream,
            NAG eager, NAG fused (`model.nag.impl=compiled`) and NAG eager with MoD at 20% (`mod`, thresholds
            from a calibration forward; its speed-up is against `nag_eager`). Each variant runs in its OWN subprocess:
            time, peak RSS of the steady state (the kernel's high-water mark VmHWM is reset after the warm-up
            through /proc/self/clear_refs, so compile-time memory does not count; CUDA: max allocated),
            and the bytes autograd saves for the backward (saved-tensor hooks; deterministic).
  moe       expert compute, grouped (`torch._grouped_mm`) vs the per-expert loop, at 8, 32, 64 experts.
  cca       CCA vs MHA attention sublayer (tools/bench/bench_cca.py).
  mod       MoD-20% vs full depth (tools/bench/bench_mod.py).
  loader    loader tokens/s (tools/bench/bench_loader.py, synthetic shards) vs the training tokens/s of `nag`.
  mfu       achieved FLOP/s of the NAG training step (analytic FLOPs, nagmoe.flops) against the FLOP/s of a
            large matmul measured in the same run ("CPU MFU"); on CUDA also against the data-sheet peak.
Threads: every process uses the same `--threads` (default OMP_NUM_THREADS, else 1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools", "bench"))

import torch  # noqa: E402

GOALS = {  # name -> (description, comparison, threshold)
    "nag_time_ratio": ("NAG / baseline step time", "<=", 1.10),
    "nag_memory_ratio": ("NAG / baseline memory (CPU: saved for backward)", "<=", 1.05),
    "moe_grouped_speedup_32": ("MoE loop / grouped time at 32 experts", ">=", 2.0),
    "loader_over_training": ("loader / training tokens per second", ">=", 20.0),
    "mod_gain_fraction": ("MoD CPU-time gain / executed-FLOP gain", ">=", 0.9),
}
GPU_GOALS = {"nag_time_ratio": 1.05}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, warmup: int, reps: int) -> list[float]:
    out = []
    for i in range(warmup + reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _summary(times: list[float]) -> dict:
    return {"min_s": min(times), "median_s": statistics.median(times), "reps": len(times)}


# ----------------------------------------------------------------------------------------------------------
# One variant of the NAG section, in its own process
# ----------------------------------------------------------------------------------------------------------
def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_nag_variant(spec: dict) -> dict:
    from nagmoe.config import load_config
    from nagmoe.flops import flops_per_token
    from nagmoe.model import build_model

    device = torch.device(spec["device"])
    cfg = load_config(spec["config"], spec["overrides"])
    m, T, rows = cfg.model, spec["seq_len"], spec["rows"]
    torch.manual_seed(0)
    model = build_model(m).to(device).train()
    idx = torch.randint(0, m.vocab_size, (rows, T), generator=torch.Generator().manual_seed(0)).to(device)
    if m.mod.skip_rate > 0:  # MoD: thresholds from one calibration forward's score histograms (as bench_mod)
        with torch.no_grad():
            model(torch.randint(0, m.vocab_size, (rows, T), generator=torch.Generator().manual_seed(1)).to(device))
        model.mod_update()
        model.set_mod_skip_rate(m.mod.skip_rate)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            out = model(idx, idx)
        (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(spec["warmup"]):  # compile (fused variant) and allocator warm-up, not measured
        step()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    rss_reset = _reset_peak_rss()
    rss_before = _peak_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _timed(step, device, 0, spec["reps"])
    tokens = rows * T
    res = {"variant": spec["name"], **_summary(times), "tokens_per_s": tokens / min(times),
           "train_flops_per_token": flops_per_token(m, T), "saved_for_backward_bytes": saved[0],
           "peak_rss_bytes": _peak_rss_bytes(), "rss_at_start_bytes": rss_before, "rss_peak_reset": rss_reset,
           # the step's own memory: peak RSS over the steps above the RSS they start from (the compiler's heap
           # and the compiled code of the fused variant stay out; parameters and grads of set_to_none do not)
           "step_peak_bytes": _peak_rss_bytes() - rss_before,
           "nag_impl": getattr(model.stream, "impl", None), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        res["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return res


def _run_child(spec: dict, threads: int, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": REPO + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec),
                           "--threads", str(threads)], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {spec['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


NAG_VARIANTS = {"baseline": ["model.residual=prenorm"], "nag_eager": ["model.nag.impl=eager"],
                "nag_fused": ["model.nag.impl=compiled"],
                "mod": ["model.nag.impl=eager", "model.mod.skip_rate=0.2", "model.mod.sublayers=all"]}


def section_nag(args, sizes) -> dict:
    out = {}
    for name in args.nag_variants.split(","):
        if name not in NAG_VARIANTS:
            raise SystemExit(f"--nag-variants: unknown variant {name!r} (known: {', '.join(NAG_VARIANTS)})")
        extra = NAG_VARIANTS[name]
        spec = {"name": name, "device": args.device, "config": sizes["config"],
                "overrides": [*sizes["overrides"], *extra], "seq_len": sizes["seq_len"], "rows": sizes["rows"],
                "warmup": sizes["warmup"] + (1 if "fused" in name else 0), "reps": sizes["reps"]}
        out[name] = _run_child(spec, args.threads, timeout=sizes["child_timeout"])
    base = out["baseline"]
    mem_key = "cuda_max_allocated_bytes" if args.device == "cuda" else "step_peak_bytes"
    for name in [n for n in ("nag_eager", "nag_fused", "mod") if n in out]:
        v = out[name]
        v["time_ratio"] = v["min_s"] / base["min_s"]
        v["time_ratio_median"] = v["median_s"] / base["median_s"]
        v["memory_ratio"] = v[mem_key] / max(1, base[mem_key])
        v["saved_bytes_ratio"] = v["saved_for_backward_bytes"] / base["saved_for_backward_bytes"]
    if "mod" in out and "nag_eager" in out:  # MoD-20% vs the same NAG model at full depth
        out["mod"]["mod_speedup"] = out["nag_eager"]["min_s"] / out["mod"]["min_s"]
    out["memory_method"] = ("torch.cuda.max_memory_allocated per subprocess" if args.device == "cuda" else
                            "step memory = peak RSS (VmHWM, reset after the warm-up) minus the RSS at the reset, "
                            "each variant in its own subprocess; bytes autograd saves for the backward beside")
    return out


# ----------------------------------------------------------------------------------------------------------
# In-process sections
# ----------------------------------------------------------------------------------------------------------
def section_moe(args, sizes) -> dict:
    from nagmoe.ops.grouped_experts import experts_grouped, experts_loop

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    S, D, H = sizes["moe_slots"], sizes["moe_d"], sizes["moe_h"]
    out = {"slots": S, "d_model": D, "expert_hidden": H, "dtype": str(dtype)}
    gen = torch.Generator().manual_seed(0)
    for E in (8, 32, 64):
        counts = torch.bincount(torch.randint(0, E, (S,), generator=gen), minlength=E).to(device)
        x = torch.randn(S, D, generator=gen).to(device, dtype)
        w_in = (torch.randn(E, D, H, generator=gen) * D ** -0.5).to(device, dtype).requires_grad_(True)
        w_out = (torch.randn(E, H, D, generator=gen) * H ** -0.5).to(device, dtype).requires_grad_(True)
        g = torch.randn(S, D, generator=gen).to(device, dtype)
        res = {}
        for name, fn in (("grouped", experts_grouped), ("loop", experts_loop)):
            def run(fn=fn):
                xg = x.detach().requires_grad_(True)
                fn(xg, w_in, w_out, counts).backward(g)
                w_in.grad = w_out.grad = None
            res[name] = _summary(_timed(run, device, sizes["warmup"], sizes["reps"]))
        res["loop_over_grouped"] = res["loop"]["min_s"] / res["grouped"]["min_s"]
        out[f"experts_{E}"] = res
    return out


def section_cca(args, sizes) -> dict:
    import bench_cca

    return bench_cca.bench(sizes["cca_config"], sizes["cca_seq"], 1, sizes["reps"], sizes["warmup"], device=args.device)


def section_mod(args, sizes) -> dict:
    import bench_mod

    return bench_mod.bench(os.path.join(REPO, "configs/tiny-mod20.yaml"), sizes["mod_rows"], sizes["reps"],
                           sizes["warmup"], overrides=tuple(sizes["mod_overrides"]), device=args.device)


def section_loader(args, sizes, training_tokens_per_s: float) -> dict:
    import bench_loader

    with tempfile.TemporaryDirectory() as root:
        data_dir = bench_loader.synthetic_data_dir(root, sizes["loader_tokens"], 4096, 1 << 20)
        res = bench_loader.bench_case(data_dir, sizes["seq_len"], sizes["rows"], 1, steps=200, warmup=5)
    return {"loader": res, "training_tokens_per_s": training_tokens_per_s,
            "loader_over_training": res["tokens_per_s"] / training_tokens_per_s}


def section_mfu(args, sizes, nag_variant: dict) -> dict:
    from nagmoe.flops import peak_flops

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = sizes["matmul_n"]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = _timed(lambda: a @ b, device, 2, max(3, sizes["reps"]))
    matmul_flops = 2 * n ** 3 / min(times)
    achieved = nag_variant["train_flops_per_token"] * nag_variant["tokens_per_s"]
    out = {"matmul_n": n, "matmul_dtype": str(dtype), "matmul_flops_per_s": matmul_flops,
           "training_flops_per_s": achieved, "mfu_vs_measured_matmul": achieved / matmul_flops}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name)
        out.update(device_name=name, datasheet_peak=peak, mfu_vs_datasheet=achieved / peak if peak else None)
    return out


# ----------------------------------------------------------------------------------------------------------
def sizes_for(args) -> dict:
    if args.smoke:
        return dict(config=os.path.join(REPO, "configs/tiny.yaml"),
                    overrides=["model.d_model=32", "model.n_layers=1", "model.vocab_size=256",
                               "model.moe.expert_hidden=32", "model.nag.C=8", "model.attention.n_heads=2"],
                    seq_len=32, rows=2, warmup=1, reps=1, child_timeout=300, moe_slots=256, moe_d=32, moe_h=32,
                    cca_config=os.path.join(REPO, "configs/tiny.yaml"), cca_seq=32, mod_rows=1,
                    mod_overrides=["model.d_model=32", "model.n_layers=1", "model.vocab_size=256",
                                   "model.moe.expert_hidden=32", "data.seq_len=32", "model.attention.n_heads=2"],
                    loader_tokens=1 << 16, matmul_n=256)
    if args.paper_width:  # GPU: paper width (d 1024), fewer layers
        return dict(config=os.path.join(REPO, "configs/paper/nag-r40.yaml"), overrides=["model.n_layers=4"],
                    seq_len=2048, rows=8, warmup=3, reps=10, child_timeout=400, moe_slots=65536, moe_d=1024,
                    moe_h=1024, cca_config=os.path.join(REPO, "configs/paper/nag-r40.yaml"), cca_seq=2048,
                    mod_rows=8, mod_overrides=[], loader_tokens=1 << 24, matmul_n=8192)
    return dict(config=os.path.join(REPO, "configs/tiny.yaml"), overrides=[], seq_len=256, rows=4, warmup=2,
                reps=5, child_timeout=400, moe_slots=2048, moe_d=128, moe_h=256,
                cca_config=os.path.join(REPO, "configs/tiny.yaml"), cca_seq=256, mod_rows=4, mod_overrides=[],
                loader_tokens=1 << 22, matmul_n=1024)


def _nag_main(nag: dict) -> str:
    """The NAG variant the goals and the training rate refer to: the fused one when it was measured."""
    return "nag_fused" if "nag_fused" in nag else "nag_eager"


def goals(result: dict, device: str) -> dict:
    values, main = {}, None
    if "nag" in result:
        main = _nag_main(result["nag"])
        nag = result["nag"][main]
        values["nag_time_ratio"] = nag["time_ratio"]
        # CPU: the bytes autograd saves for the backward (deterministic); the step-RSS ratio beside it moves
        # with what the allocator kept from the warm-up. CUDA: max allocated.
        values["nag_memory_ratio"] = nag["memory_ratio"] if device == "cuda" else nag["saved_bytes_ratio"]
    if "moe" in result:
        values["moe_grouped_speedup_32"] = result["moe"]["experts_32"]["loop_over_grouped"]
    if "loader" in result:
        values["loader_over_training"] = result["loader"]["loader_over_training"]
    if "mod" in result:
        # process CPU time at 1 thread measures the work even when other jobs share the cores
        values["mod_gain_fraction"] = result["mod"]["cpu_gain_fraction_of_flop_gain"]
    out = {}
    for key, value in values.items():
        desc, op, threshold = GOALS[key]
        if device == "cuda":
            threshold = GPU_GOALS.get(key, threshold)
        met = value <= threshold if op == "<=" else value >= threshold
        if key.startswith("nag_"):
            desc = desc.replace("NAG", f"NAG ({main.split('_')[1]})")
        out[key] = {"goal": f"{desc} {op} {threshold}", "value": value, "met": bool(met)}
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"## Benchmark suite (issue 14)", f"{result['date']}, {m['platform']}, {m['cpus']} CPUs, torch "
             f"{m['torch']}, device {result['device']}, {result['threads']} thread(s) per process. "
             f"`{result['command']}`. Min of {result['sizes']['reps']} repetitions after "
             f"{result['sizes']['warmup']} warm-up (median in brackets); ratios from the minima.", "",
             "| goal | value | met |", "|---|---|---|"]
    for g in result["goals"].values():
        lines.append(f"| {g['goal']} | {g['value']:.3f} | {'met' if g['met'] else 'NOT met'} |")
    if "nag" in result:
        n = result["nag"]
        lines += ["", f"NAG vs baseline ({n['memory_method']}):", "",
                  "| variant | step s (median) | tokens/s | step memory MB | saved for backward MB | time / base "
                  "| mem / base | saved / base |", "|---|---|---|---|---|---|---|---|"]
        for name in [k for k in NAG_VARIANTS if k in n]:
            v = n[name]
            mem = v.get("cuda_max_allocated_bytes", v["step_peak_bytes"])
            lines.append(f"| {name} | {v['min_s']:.4f} ({v['median_s']:.4f}) | {v['tokens_per_s']:.0f} | "
                         f"{mem / 2**20:.1f} | {v['saved_for_backward_bytes'] / 2**20:.1f} | "
                         f"{v.get('time_ratio', 1.0):.3f} | {v.get('memory_ratio', 1.0):.3f} | "
                         f"{v.get('saved_bytes_ratio', 1.0):.3f} |")
    if "moe" in result:
        mo = result["moe"]
        lines += ["", f"MoE experts ({mo['slots']} slots, D {mo['d_model']}, H {mo['expert_hidden']}, "
                  f"{mo['dtype']}, forward + backward):", "", "| experts | grouped s | loop s | loop / grouped |",
                  "|---|---|---|---|"]
        for E in (8, 32, 64):
            r = mo[f"experts_{E}"]
            lines.append(f"| {E} | {r['grouped']['min_s']:.4f} | {r['loop']['min_s']:.4f} | "
                         f"{r['loop_over_grouped']:.2f} |")
    if "cca" in result:
        r = result["cca"]["cca_over_mha"]
        lines += ["", f"CCA / MHA (d {result['cca']['d_model']}, seq {result['cca']['seq_len']}): params "
                  f"{r['params']:.3f}, forward FLOPs {r['forward_flops_per_token']:.3f}, forward+backward time "
                  f"{r['forward_backward_s']:.3f} (median {r['forward_backward_s_median']:.3f}), KV bytes "
                  f"{r['kv_cache_bytes_per_token_fp32']:.3f}."]
    if "mod" in result:
        r = result["mod"]
        lines += ["", f"MoD-20% vs full depth: speed-up {r['wall_clock_speedup']:.3f} (median "
                  f"{r['speedup_median']:.3f}) against an executed-FLOP ratio {r['executed_flop_ratio']:.3f}; "
                  f"CPU-time speed-up {r['cpu_speedup']:.3f}."]
    if "loader" in result:
        r = result["loader"]
        lines += ["", f"Loader {r['loader']['tokens_per_s']:.3g} tokens/s vs training (NAG step) "
                  f"{r['training_tokens_per_s']:.3g} tokens/s: {r['loader_over_training']:.0f}x."]
    if "mfu" in result:
        r = result["mfu"]
        lines += ["", f"MFU: training step {r['training_flops_per_s'] / 1e9:.2f} GFLOP/s (analytic FLOPs) vs a "
                  f"{r['matmul_n']}^3 {r['matmul_dtype']} matmul {r['matmul_flops_per_s'] / 1e9:.2f} GFLOP/s in "
                  f"the same run: {100 * r['mfu_vs_measured_matmul']:.1f}%"
                  + (f"; vs the data-sheet peak {100 * r['mfu_vs_datasheet']:.1f}%" if r.get("mfu_vs_datasheet")
                     else "") + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition (CI)")
    ap.add_argument("--paper-width", action="store_true", help="paper width (GPU)")
    ap.add_argument("--sections", default="nag,moe,cca,mod,loader,mfu")
    ap.add_argument("--nag-variants", default="baseline,nag_eager,nag_fused,mod",
                    help=f"variants of the nag section (baseline first): {', '.join(NAG_VARIANTS)}")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or 1))
    ap.add_argument("--out", default=None, help="write the JSON here (it is always printed)")
    ap.add_argument("--markdown", default=None, help="write the docs/benchmarks.md section here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(child_nag_variant(json.loads(args.child))))
        return 0
    sections = args.sections.split(",")
    sizes = sizes_for(args)
    t0 = time.perf_counter()
    result = {"benchmark": "suite", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(), "torch": torch.__version__},
              "device": args.device, "threads": args.threads, "sizes": sizes,
              "command": "python tools/bench/bench_suite.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    timings = {}
    for name in sections:
        s0 = time.perf_counter()
        if name == "nag":
            result["nag"] = section_nag(args, sizes)
        elif name == "moe":
            result["moe"] = section_moe(args, sizes)
        elif name == "cca":
            result["cca"] = section_cca(args, sizes)
        elif name == "mod":
            result["mod"] = section_mod(args, sizes)
        elif name == "loader":
            train_tps = result["nag"][_nag_main(result["nag"])]["tokens_per_s"] if "nag" in result else float("nan")
            result["loader"] = section_loader(args, sizes, train_tps)
        elif name == "mfu":
            if "nag" in result:
                result["mfu"] = section_mfu(args, sizes, result["nag"][_nag_main(result["nag"])])
        else:
            raise SystemExit(f"--sections: unknown section {name!r}")
        timings[name] = time.perf_counter() - s0
        print(f"[bench_suite] {name}: {timings[name]:.1f} s", file=sys.stderr, flush=True)
    result["section_seconds"] = timings
    result["total_seconds"] = time.perf_counter() - t0
    result["goals"] = goals(result, args.device)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
