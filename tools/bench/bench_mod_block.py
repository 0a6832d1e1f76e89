"""MoD block benchmark (issue 28): one transformer block of the final r40 paper config (d 512, CCA, 32 experts
top-4 of width 2048, NAG), sequence 2048, forward + backward, Mixture-of-Depths at 0/10/20/30% token skip on
both sublayers against full depth (`python tools/bench/bench_mod.py --block`).

Method. One block, one set of weights, one input state (NAG direction and log-norm) with a gradient. For a
skip rate r each sublayer's threshold is the r-quantile of its rotation scores on this input (the
calibrator's `fixed`-style threshold per sublayer, set directly), so both sublayers skip r of the tokens.
Repeats are paired: within a repeat the variants alternate step by step (the order rotated each repeat),
`--inner` rounds, and each variant's fastest step is kept — the machine's speed drifts over seconds on a shared
VM, so only neighbouring steps compare, and a neighbour's burst inflates one step, not the minimum. Timed in
process CPU time (immune to other jobs on a shared machine; wall clock beside it). On CPU, glibc is told to
keep freed memory (`--allocator caching`, the default: what CUDA's caching allocator does) so large tensors
are not fresh mmaps paying page faults each step; at 16 rows glibc still refaults the 1 GiB tensors of full
depth, and `--allocator jemalloc` runs the command again under jemalloc (each result reports its page faults
per variant, `minor_faults_per_step`). The speed-up of a rate is the median over repeats of
full / MoD; its 95% confidence interval comes from a bootstrap over the paired repeats. The realised share
is (speed-up - 1) / (charged-FLOP ratio - 1): the charged FLOPs (nagmoe.flops, non_embedding convention,
executed tokens only) are what buys tokens under a budget; the executed FLOPs with attention's padded query
rows are reported beside them. Verdict on the interval's lower bound (>= 0.8 meets issue 28's bar, measured
at `--block-rows 4`: one row per step leaves each expert a sixteenth of its paper rows, docs/decisions.md).
`time_vs_charged_flops` fits a line through every rate's time ratio against its charged-FLOP ratio: its
`fixed_share` is the part of the full step that MoD cannot shrink (on CPU: the experts' per-call weight passes
and every token's element-wise NAG work), `share_from_fit` what that line realises at each rate (`--rates
0.2,0.5,0.9` spreads the points). `--profile` adds a table of self CPU time per step by kind of op (a
profiled step that faults in fresh pages is retaken).
The NAG update and modulator run `compiled` (torch.compile), what `auto` picks on CUDA and the paper's runs
execute (`model.nag.impl=eager` measures the eager reference; `--smoke` keeps `auto`, eager on CPU, to skip
inductor's first compile).
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

from contextlib import nullcontext
from typing import Optional

import torch

from nagmoe.train.precision_context import TrainingPrecision

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "paper", "nag-mod20-r40.yaml")
RATES = (0.1, 0.2, 0.3)
SMOKE = ("model.d_model=64", "model.attention.n_heads=8", "model.moe.n_experts=4", "model.moe.top_k=2",
         "model.moe.expert_hidden=64", "model.nag.C=8", "model.vocab_size=512", "data.seq_len=128")
# op name fragments -> the kinds of work issue 28 asks to see separately (first match wins)
KINDS = (("experts", ("_grouped_mm",)), ("scores", ("scaled_dot_product", "softmax", "bmm", "baddbmm")),
         ("projections", ("aten::mm", "aten::addmm", "aten::linear", "convolution")),
         ("gather/scatter", ("index_select", "index_copy", "index_add", "scatter", "gather", "index",
                             "nonzero", "argsort", "sort")),
         ("masks", ("arange", "aten::le", "aten::lt", "aten::gt", "where", "cumsum", "cummax", "masked")),
         ("NAG elementwise", ("mul", "add", "sub", "div", "rsqrt", "sqrt", "exp", "log", "sigmoid", "pow",
                              "sum", "mean", "clamp", "atan", "tanh", "relu", "square")))


# mallopt takes an int: the largest mmap threshold it can set. At 16 rows full depth's expert hidden tensors are
# 1 GiB exactly (131,072 slots x 2048 x 4 bytes); with a 1 GiB threshold they were fresh mmaps faulting in
# 262,144 pages every step while MoD's 0.8 GiB ones were reused, a bias towards MoD.
MMAP_THRESHOLD_MAX = 2 ** 31 - 1
NO_TRIM = -1  # M_TRIM_THRESHOLD -1: never give the heap's top back (man mallopt; the tool's earlier 2 ** 31
#               wrapped to a negative int and meant the same by accident)


def use_caching_allocator() -> bool:
    """Make glibc keep freed memory for reuse, as CUDA's caching allocator does: no mmap per large tensor
    (M_MMAP_THRESHOLD at mallopt's largest value, 2 GiB) and no trimming of the heap's top (M_TRIM_THRESHOLD
    -1; the setting before, 2 ** 31, wrapped to a negative int and meant the same). Without it every activation of
    more than 32 MB is a fresh mmap whose pages fault in (zeroed) on first touch: at r40 shape ~20% of a CPU
    step, and the largest source of step-to-step noise (`minor_faults_per_step` in the result shows what is
    left). False where the C library has no mallopt (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, NO_TRIM))


JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"  # freed pages never given back: reused, as CUDA's allocator
JEMALLOC_MARK = "NAGMOE_BENCH_JEMALLOC"  # set on the re-run: a second re-run would loop


def jemalloc_loaded() -> bool:
    """jemalloc is this process's malloc (preloaded): its library is mapped."""
    try:
        with open("/proc/self/maps") as maps:
            return "libjemalloc" in maps.read()
    except OSError:
        return False


def run_under_jemalloc(argv: list) -> None:
    """`--allocator jemalloc`: run this command again with jemalloc preloaded and its decay off, unless it is
    already. glibc's malloc serves torch's 64-byte-aligned requests of 1 GiB (a 16-row step's expert hidden
    tensors) from fresh heap each time (strace: the break grows 1 GiB per allocation): at 16 rows full depth
    faulted in 1.3 M pages a step and MoD 0.2 M, a bias towards MoD. jemalloc's size classes reuse them. Exits
    with one line (code 2) where jemalloc is not installed."""
    import ctypes.util

    if jemalloc_loaded():
        return
    lib = ctypes.util.find_library("jemalloc")
    if lib is None or os.environ.get(JEMALLOC_MARK):
        why = "is not installed (apt-get install libjemalloc2)" if lib is None else f"{lib} did not load"
        print(f"bench_mod.py: --allocator jemalloc: jemalloc {why}", file=sys.stderr)
        raise SystemExit(2)
    preload = " ".join(p for p in (lib, os.environ.get("LD_PRELOAD", "")) if p)
    env = {**os.environ, "LD_PRELOAD": preload, "MALLOC_CONF": JEMALLOC_CONF, JEMALLOC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def build_block(overrides=(), seed: int = 0, device: str = "cpu"):
    """(config, model with one block, its NAG stream) of the r40 MoD config; MoD thresholds set by hand."""
    from nagmoe.config import load_config
    from nagmoe.model import build_model

    cfg = load_config(CONFIG, ["model.n_layers=1", "parallel.ep=1", "model.mod.threshold=fixed",
                               "model.mod.p_thres=0.5", "model.mod.start_tokens=0", *overrides])
    torch.manual_seed(seed)
    model = build_model(cfg.model, device=device).train()
    model.set_mod_seq_len(cfg.data.seq_len)
    model.set_injection_warmup(1.0)
    return cfg, model


def block_input(cfg, rows: int, seed: int = 0, device: str = "cpu"):
    from nagmoe.model.residual import NAGState

    g = torch.Generator().manual_seed(seed)
    d = torch.randn(rows, cfg.data.seq_len, cfg.model.d_model, generator=g)
    d = d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True))
    return NAGState((torch.randn(rows, cfg.data.seq_len, generator=g) * 0.1).to(device), d.to(device))


def set_skip(model, state, rate: float) -> list:
    """Thresholds so that each sublayer skips `rate` of this input's tokens; the executed fractions."""
    cal = model.mod_calibrator()
    with torch.no_grad():
        cal.skipping.fill_(rate > 0)
        cal.threshold.fill_(-1.0)
        state_k = state
        for index, _ in enumerate(model.sublayers()):
            score = _scores(model, state_k, index)
            cal.threshold[index] = torch.quantile(score.flatten().float(), rate) if rate > 0 else -1.0
            state_k = run_block(model, state, upto=index + 1)  # the next sublayer's input
    return [float(f) for f in executed_fractions(model, state)]


def use_thresholds(model, threshold, skipping: bool) -> None:
    cal = model.mod_calibrator()
    with torch.no_grad():
        cal.threshold.copy_(threshold)
        cal.skipping.fill_(skipping)


def run_block(model, state, upto=None):
    from nagmoe.model.mod import run_on_executed
    import functools

    for index, sublayer in enumerate(model.sublayers()):
        if upto is not None and index >= upto:
            break
        if index % 2 == 1:
            sublayer = functools.partial(run_on_executed, sublayer)
        state, _ = model.stream.apply(index, sublayer, state)
    return state


def executed_fractions(model, state) -> list:
    cal = model.mod_calibrator()
    with torch.no_grad():
        cal.eval()
        cal.reset_inference_counts()
        run_block(model, state)
        out = cal.inference_fractions()
        cal.train()
    return out


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where `resource` is missing: not POSIX)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def step_seconds(model, state, probe, amp=nullcontext) -> tuple[float, float]:
    """(process CPU, wall) seconds of one forward (under `amp()`, the Trainer's autocast) + backward of the
    block; on CUDA both are the synchronised wall clock (the host's CPU time says nothing about the kernels)."""
    cal = model.mod_calibrator()
    x = type(state)(state.log_norm_BT.clone().requires_grad_(True), state.direction_BTD.clone().requires_grad_(True))
    cuda = probe.is_cuda
    if cuda:
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    with amp():
        out = run_block(model, x)
    ((out.direction_BTD * probe).sum() + out.log_norm_BT.sum()).backward()
    if cuda:
        torch.cuda.synchronize()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    cpu = wall if cuda else cpu
    model.zero_grad(set_to_none=True)
    for buf in (cal.pending_hist, cal.pending_executed, cal.pending_tokens, cal.pending_padded):
        buf.zero_()
    return cpu, wall


def bootstrap_median_ci(ratios: list, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def fixed_time_fit(points: list) -> dict:
    """Least-squares line `time ratio = fixed + slope x charged-FLOP ratio` through (1, 1) (full depth) and each
    rate's (charged-FLOP ratio F_r / F_0, median of its paired MoD / full step times). `fixed` is the share of the
    full step that does not shrink with the charged FLOPs (every-token element-wise work, per-call weight reads,
    launch and dispatch overheads): a linear step realises (1 / (fixed + slope x) - 1) / (1 / x - 1) of the
    gain, 1 only at fixed 0. On a noisy machine it uses every rate's median, so it is steadier than any one."""
    pts = [(1.0, 1.0), *points]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")
    fixed = my - slope * mx
    shares = [(1 / (fixed + slope * x) - 1) / (1 / x - 1) for x, _ in points]
    return {"points": [[round(x, 4), round(y, 4)] for x, y in pts], "fixed_share": fixed, "slope": slope,
            "share_from_fit": shares}


PROFILE_FAULTS = 1000  # minor page faults above which a profiled step is retaken
PROFILE_TRIES = 4


def profiled_step(model, state, probe, amp=nullcontext, faults=None):
    """One step under torch.profiler without fresh pages: `(profiler, its page faults)`. Under the profiler,
    consecutive full-depth r40 steps fault in fresh pages (65,000-260,000 a step on the 2-core VM), which
    inflated the element-wise ops 5-15x in the table; a step with more than PROFILE_FAULTS is retaken after
    an unprofiled one (the allocator settles), up to PROFILE_TRIES times, the last kept whatever it shows.
    `faults`: the fault counter (minor_faults)."""
    from torch.profiler import profile

    faults = faults or minor_faults
    for attempt in range(PROFILE_TRIES):
        before = faults()
        with profile() as prof:
            step_seconds(model, state, probe, amp)
        n = faults() - before
        if n <= PROFILE_FAULTS or attempt == PROFILE_TRIES - 1:
            return prof, n
        step_seconds(model, state, probe, amp)


def profile_table(model, state, probe, variants: dict, steps: int = 2, amp=nullcontext,
                  faults_kept: Optional[dict] = None) -> dict:
    """Self CPU seconds per step by kind of op, per variant (`variants`: label -> (thresholds, skipping)). The
    variants take turns one profiled step at a time, like the timed repeats, so a drift of the machine's speed
    hits them alike; `steps` rounds, averaged; each step without page faults where a retake gets one
    (profiled_step; `faults_kept[label]` lists the kept steps' faults)."""
    tables = {label: {**{name: 0.0 for name, _ in KINDS}, "other": 0.0} for label in variants}
    for _ in range(steps):
        for label, (threshold, skipping) in variants.items():
            use_thresholds(model, threshold, skipping)
            prof, n = profiled_step(model, state, probe, amp)
            if faults_kept is not None:
                faults_kept.setdefault(label, []).append(n)
            for e in prof.key_averages():
                kind = next((name for name, keys in KINDS if any(k in e.key for k in keys)), "other")
                tables[label][kind] += e.self_cpu_time_total / 1e6 / steps
    return {label: {k: round(v, 4) for k, v in table.items()} for label, table in tables.items()}


def bench_block(rows: int = 1, repeats: int = 7, rates=RATES, smoke: bool = False, profile: bool = False,
                profile_steps: int = 2, seed: int = 0, device: str = None, inner: int = 3, overrides=(),
                allocator: str = "caching") -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if allocator == "caching" and device == "cpu" and not use_caching_allocator():
        allocator = "default (no mallopt here)"
    if allocator == "jemalloc":
        if not jemalloc_loaded():
            raise ValueError("allocator='jemalloc': jemalloc is not this process's malloc (run_under_jemalloc)")
        allocator = f"jemalloc ({os.environ.get('MALLOC_CONF', 'its defaults')})"
    # the paper runs' NAG path: `auto` compiles it on CUDA; asked for here so CPU measures it too (overrides
    # win, e.g. model.nag.impl=eager); the smoke keeps `auto`: inductor's first compile would be most of its time
    nag = () if smoke else ("model.nag.impl=compiled",)
    cfg, model = build_block((*(SMOKE if smoke else ()), *nag, *overrides), seed, device)
    # the Trainer's precision and compile setting: bf16 autocast and TF32 on CUDA (on the CPU fp32, or bf16 under
    # CUDA's rules with NAGMOE_CUDA_RULES), sublayers compiled where train.compile resolves on (auto: CUDA)
    precision = TrainingPrecision(device)
    with precision.scope():
        return _bench_block(cfg, model, precision, rows, repeats, rates, smoke, profile, profile_steps, seed, device,
                            inner, overrides, allocator)


def _bench_block(cfg, model, precision, rows, repeats, rates, smoke, profile, profile_steps, seed, device, inner,
                 overrides, allocator) -> dict:
    from nagmoe.flops import executed_flops_per_token, flops_per_token
    from nagmoe.train.backends_ran import collect as collect_backends_ran
    from nagmoe.train.speed import compile_model, resolve_compile

    amp = precision.autocast
    if device == "cuda" and cfg.train.precision == "uniform":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    compiled = compile_model(model) if resolve_compile(cfg.train.compile, device) else None
    state = block_input(cfg, rows, seed, device)
    probe = torch.randn(state.direction_BTD.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    m, T = cfg.model, cfg.data.seq_len
    variants = {0.0: None, **{r: None for r in rates}}
    fractions, padded = {}, {}
    thresholds = {}
    for r in variants:
        with amp():
            fractions[r] = set_skip(model, state, r)
        thresholds[r] = model.mod_calibrator().threshold.clone()
        with torch.no_grad(), amp():  # attention's query rows per token, padded to the longest sequence: max_b n_b / T
            executed_B = (_scores(model, state, 0) > thresholds[r][0]).sum(1)
        padded[r] = [float(executed_B.max()) / T if r > 0 else 1.0, fractions[r][1]]
    cpu = {r: [] for r in variants}
    wall = {r: [] for r in variants}
    page_faults = {r: [] for r in variants}  # minor page faults of every timed step (none: memory reused)
    order = list(variants)
    for rep in range(repeats + 1):  # the first round warms up
        best = {r: (float("inf"), float("inf")) for r in variants}
        # the variants alternate step by step (the order rotated each repeat), `inner` rounds, the fastest step
        # of each kept: the machine's speed drifts over seconds on a shared VM, so only neighbouring steps
        # compare; a neighbour's burst inflates one step, not the minimum
        for _ in range(inner):
            for r in order[rep % len(order):] + order[:rep % len(order)]:
                use_thresholds(model, thresholds[r], r > 0)
                faults = minor_faults()
                best[r] = min(best[r], step_seconds(model, state, probe, amp))
                if rep:
                    page_faults[r].append(minor_faults() - faults)
        if rep:
            for r in variants:
                cpu[r].append(best[r][0])
                wall[r].append(best[r][1])
            # progress on stderr (the JSON goes to stdout): a long run shows how it stands
            print(f"repeat {rep}/{repeats}: full {cpu[0.0][-1]:.2f} s, speed-up " + ", ".join(
                f"{r:.0%} x{cpu[0.0][-1] / cpu[r][-1]:.3f}" for r in rates), file=sys.stderr, flush=True)
    full = flops_per_token(m, T, 1.0, "non_embedding")
    impl = model.mod_calibrator().resolved_impl(device)  # what the executed FLOPs price (issue 69)
    out_rates, fit_points = [], []
    for r in rates:
        ratios = [f / x for f, x in zip(cpu[0.0], cpu[r])]
        speedup = statistics.median(ratios)
        lo, hi = bootstrap_median_ci(ratios)
        charged = full / flops_per_token(m, T, fractions[r], "non_embedding")
        executed = full / executed_flops_per_token(m, T, fractions[r], padded[r], "non_embedding", impl)
        share = lambda s: (s - 1) / (charged - 1)  # noqa: E731
        fit_points.append((1 / charged, statistics.median(1 / q for q in ratios)))  # MoD / full per repeat
        out_rates.append({
            "skip_rate": r, "executed_fractions": fractions[r], "padded_attention_rows": padded[r][0],
            "cpu_speedup_median": speedup, "cpu_speedup_ci95": [lo, hi],
            "cpu_speedup_per_repeat": [round(x, 4) for x in ratios],
            "wall_speedup_median": statistics.median(f / x for f, x in zip(wall[0.0], wall[r])),
            "charged_flop_ratio": charged, "executed_flop_ratio_with_padding": executed,
            "realised_share": share(speedup), "realised_share_ci95": [share(lo), share(hi)],
            "verdict": "meets (lower bound >= 0.8)" if share(lo) >= 0.8 else "below 0.8 at the lower bound"})
    result = {"benchmark": "mod_block", "config": os.path.relpath(CONFIG, REPO), "smoke": smoke, "mod_impl": impl,
              "d_model": m.d_model, "experts": m.moe.n_experts, "top_k": m.moe.top_k, "seq_len": T, "rows": rows,
              "repeats": repeats, "inner": inner, "overrides": list(overrides),
              "allocator": allocator if device == "cpu" else "cuda caching", "threads": torch.get_num_threads(),
              "nag_impl": getattr(model.stream, "impl", None),  # the resolved NAG backend (eager, compiled)
              "precision": {**precision.describe(), "compute_dtype": str(precision.autocast_dtype or torch.float32)
                            .split(".")[-1], "tf32": device == "cuda" and torch.backends.cuda.matmul.allow_tf32},
              "compile": (f"{compiled['unit']}s ({', '.join(compiled['classes'])}), {compiled['backend']}"
                          if compiled else "off"),
              "expert_backend": model.blocks[0].ffn.backend,
              "device": device,
              "timing": "synchronised wall clock" if device == "cuda" else "process CPU time",
              "full_cpu_s_median": statistics.median(cpu[0.0]),
              "full_cpu_s_range": [min(cpu[0.0]), max(cpu[0.0])], "rates": out_rates,
              "minor_faults_per_step": {f"{r:g}": statistics.mean(page_faults[r]) for r in variants},
              "time_vs_charged_flops": fixed_time_fit(fit_points),
              "backends_ran": collect_backends_ran(model)}  # the kernels the timed steps ran, fallbacks named
    if profile:
        kept = {}
        result["profile_s_per_step"] = profile_table(
            model, state, probe, {f"skip {r:.0%}": (thresholds[r], r > 0)
                                  for r in (0.0, 0.2 if 0.2 in variants else rates[0])}, steps=profile_steps,
            amp=amp, faults_kept=kept)
        result["profile_minor_faults"] = kept
    return result


def bench_attention_kernels(rows: int = 1, repeats: int = 15, inner: int = 3, rate: float = 0.2, seed: int = 0,
                            smoke: bool = False, overrides=()) -> dict:
    """The attention sublayer's score kernel alone at r40 shape (forward + backward, process CPU time): full
    causal attention over every query against the executed queries (`rate` skipped by the block's own rotation
    scores) through the blocked SDPA with its explicit mask and through the chunked CPU kernel
    (nagmoe/ops/position_attention.py). Variants alternate step by step, `inner` rounds per repeat (fastest
    kept); the median over repeats of each variant's time over full causal's."""
    from nagmoe.model.attention import attention_at_positions, causal_attention
    from nagmoe.model.mod import ExecutedTokens
    from nagmoe.ops.position_attention import POSITION_CHUNK

    cfg, model = build_block((*(SMOKE if smoke else ()), *overrides), seed)
    state = block_input(cfg, rows, seed)
    with torch.no_grad():
        score = _scores(model, state, 0)
        mask = score > torch.quantile(score.flatten().float(), rate)
    attn, T = model.blocks[0].attn, cfg.data.seq_len
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, attn.n_heads, T, attn.head_dim, generator=g)
    k, v = (torch.randn(rows, attn.n_kv_heads, T, attn.head_dim, generator=g) for _ in range(2))
    chunk = 32 if smoke else POSITION_CHUNK  # the smoke's 128 positions still make several chunks
    sel = ExecutedTokens(mask, chunk=chunk)
    positions, _ = sel.padded()
    q_exec = sel.gather_padded(q.transpose(1, 2)).transpose(1, 2).contiguous()
    variants = {
        "full causal": (q, lambda q_, k_, v_: causal_attention(q_, k_, v_, "sdpa")),
        "blocked sdpa": (q_exec, lambda q_, k_, v_: attention_at_positions(
            q_, k_, v_, "sdpa", positions, key_ends=sel.key_ends)),
        "chunked": (q_exec, lambda q_, k_, v_: attention_at_positions(
            q_, k_, v_, "sdpa", positions, key_ends=sel.key_ends, chunks=sel.position_chunks(0))),
    }

    def seconds(q0, fn):
        q_, k_, v_ = (t.clone().requires_grad_(True) for t in (q0, k, v))
        c0 = time.process_time()
        fn(q_, k_, v_).sum().backward()
        return time.process_time() - c0

    times = {name: [] for name in variants}
    for rep in range(repeats + 1):  # the first round warms up
        best = {name: float("inf") for name in variants}
        for _ in range(inner):  # the variants take turns, one step each
            for name in variants:
                best[name] = min(best[name], seconds(*variants[name]))
        if rep:
            for name in variants:
                times[name].append(best[name])
    ratios = {name: statistics.median(t / f for t, f in zip(times[name], times["full causal"])) for name in variants}
    return {"benchmark": "mod_attention_kernels", "config": os.path.relpath(CONFIG, REPO), "smoke": smoke,
            "rows": rows, "seq_len": T, "heads": attn.n_heads, "kv_heads": attn.n_kv_heads,
            "head_dim": attn.head_dim, "chunk": chunk, "executed_fraction": float(mask.float().mean()),
            "repeats": repeats,
            "inner": inner, "threads": torch.get_num_threads(), "timing": "process CPU time",
            "median_s": {name: statistics.median(t) for name, t in times.items()},
            "median_ratio_to_full_causal": ratios}


def _scores(model, state, index):
    """Sublayer `index`'s rotation scores for the tokens of `state` (its input)."""
    from nagmoe.model.nag import rotation_score

    gate = model.stream.gates[index]
    m = model.stream.ops.modulator(state.direction_BTD, gate.weight, gate.bias, gate.coef, gate.beta_raw, gate.floor)
    return rotation_score(gate.alpha, m)
